"""Option and Plan: one layout and what it costs (or why it was rejected), and every layout a search considered."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Literal, TypeAlias, get_args

from stagewise.partition import Partition
from stagewise.plan.plan_file import sectioned
from stagewise.plan.workload import Workload
from stagewise.schedule import ScheduleName
from stagewise.schedule.simulate import SimulationResult

Checkpointing: TypeAlias = bool | Literal["selective"]
"""Activation checkpointing: none, whole layers (each keeps its input and recomputes its forward), or
``"selective"`` (each keeps its input and its matmuls' and fused attention's outputs, and recomputes the rest)."""
Gather: TypeAlias = Literal["step", "micro-batch"]
"""When FSDP gathers a stage's parameters: once a step, held whole through it (with whole gradients), or before
each of the stage's actions and freed after (ZeRO-3 within the pipeline; gradients reduce-scattered after each
backward)."""
GATHERS: tuple[Gather, ...] = get_args(Gather)


@dataclass(frozen=True)
class Option:
    """One layout and what it costs, or why it was rejected."""

    pp: int
    dp: int
    n_virtual: int
    n_microbatches: int
    schedule: ScheduleName
    activation_checkpointing: Checkpointing
    partition: Partition | None = None
    step_time: float = math.inf
    """Predicted seconds per optimizer step."""
    bubble: float = 0.0
    rank_memory: tuple[float, ...] = ()
    """Predicted peak bytes of each pipeline rank (parameter state plus activations)."""
    rank_activation: tuple[float, ...] = ()
    """Predicted peak bytes of saved activations on each pipeline rank."""
    samples_per_second: float = 0.0
    rejected: str | None = None
    """Why the layout does not work; None when it does."""
    simulation: SimulationResult | None = field(default=None, repr=False, compare=False)
    fsdp: int = 1
    """Ranks each replica shards its stages over (FSDP; with ``dp > 1``, HSDP)."""
    tp: int = 1
    """Ranks each layer is split over (tensor parallelism), within one node."""
    fsdp_gather: Gather = "step"
    """When the FSDP shards gather a stage's parameters (:data:`Gather`); "micro-batch" only with ``fsdp > 1``."""
    offload_optimizer: bool = False
    """Optimizer state and fp32 master weights in host memory, the optimizer stepping on the host."""
    offload_activations: bool = False
    """Saved activations sent to host memory during forward and brought back for backward."""
    rank_host_memory: tuple[float, ...] = ()
    """Predicted host bytes each pipeline rank keeps with offloading (optimizer state, activations); empty
    without."""
    ep: int = 1
    """Ranks each mixture-of-experts layer's routed experts are split over (expert parallelism), borrowed from
    ``fsdp`` (which it divides) or, with ``fsdp = 1``, from ``dp`` (see :attr:`stagewise.comm.Layout.ep`)."""

    @property
    def ranks_per_stage(self) -> int:
        """The ranks of one stage: ``dp x fsdp x tp``."""
        return self.dp * self.fsdp * self.tp

    @property
    def batch_shards(self) -> int:
        """The ranks of a stage that take their own share of the batch: ``dp x fsdp``."""
        return self.dp * self.fsdp

    @property
    def options(self) -> tuple[str, ...]:
        """The memory options it uses, as :meth:`describe` names them: ``+ckpt`` (whole layers), ``+sel-ckpt``
        (selective), ``+gather/mb`` (FSDP gathering per micro-batch), ``+offload-opt``, ``+offload-act``."""
        used = []
        if self.activation_checkpointing == "selective":
            used.append("+sel-ckpt")
        elif self.activation_checkpointing:
            used.append("+ckpt")
        if self.fsdp_gather == "micro-batch":
            used.append("+gather/mb")
        if self.offload_optimizer:
            used.append("+offload-opt")
        if self.offload_activations:
            used.append("+offload-act")
        return tuple(used)

    def describe(self) -> str:
        """The layout in one line: ``pp=8 dp=1 fsdp=4 ep=2 tp=2 m=128 interleaved-1f1b +ckpt`` (:attr:`options`;
        fsdp, ep and tp where above 1)."""
        sharded = "".join(f" {name}={getattr(self, name)}" for name in ("fsdp", "ep", "tp") if getattr(self, name) > 1)
        used = "".join(f" {o}" for o in self.options)
        return f"pp={self.pp} dp={self.dp}{sharded} m={self.n_microbatches} {self.schedule}{used}"


@dataclass(frozen=True)
class Plan:
    """Every layout considered: the feasible ones fastest first, the rejected ones with their reasons; searched for
    the ``top`` fastest, those and the rejections of the layouts evaluated, the others counted in :attr:`unranked`."""

    options: tuple[Option, ...]
    rejected: tuple[Option, ...]
    smallest_memory: float | None
    """When nothing fits: the least memory per device that some layout would need."""
    unranked: tuple[Option, ...] = ()
    """Searched for the ``top`` fastest (:func:`~stagewise.plan.plan`'s ``top``): the layouts in neither list,
    because they cannot be among the ``top`` fastest: a lower bound of their step time is slower than the
    ``top``-th's, no split of their stages fits the devices' memory, or they fit and are slower. Empty otherwise."""

    @property
    def best(self) -> Option | None:
        return self.options[0] if self.options else None

    def to_json(
        self,
        workload: Workload,
        *,
        model: str,
        seq_len: int | None,
        optimizer: str | None = None,
        schedule_text: str | None = None,
    ) -> str:
        """The best option as the JSON that ``stagewise train --plan`` reads, in a job file's sections and names
        (see :mod:`stagewise.plan.plan_file`); with ``schedule_text``, a schedule (synthesised for its stages) that
        train runs instead of the option's."""
        best = self.best
        if best is None or best.partition is None:
            raise ValueError("no layout fits, so there is no plan to write")
        fields = {
            "model": model,
            "seq_len": seq_len,
            "pp": best.pp,
            "dp": best.dp,
            "fsdp": best.fsdp,
            "tp": best.tp,
            "ep": best.ep,
            "virtual": best.n_virtual,
            "partition": list(best.partition.bounds),
            "schedule": best.schedule,
            **({"schedule_text": schedule_text} if schedule_text is not None else {}),
            "microbatches": best.n_microbatches,
            "batch_size": workload.global_batch,
            "optimizer": optimizer,
            "fsdp_gather": best.fsdp_gather,
            "offload_optimizer": best.offload_optimizer,
            "activation_checkpointing": best.activation_checkpointing,
            "offload_activations": best.offload_activations,
            "predicted": {
                "step_time": best.step_time,
                "bubble": best.bubble,
                "rank_memory": list(best.rank_memory),
                "rank_activation": list(best.rank_activation),
                **({"rank_host_memory": list(best.rank_host_memory)} if best.rank_host_memory else {}),
            },
        }
        return json.dumps(sectioned(fields), indent=1)
