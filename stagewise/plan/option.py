"""Option and Plan: one layout and what it costs (or why it was rejected), and every layout a search considered."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

from stagewise.partition import Partition
from stagewise.plan.plan_file import sectioned
from stagewise.plan.workload import Workload
from stagewise.schedule import ScheduleName
from stagewise.schedule.simulate import SimulationResult


@dataclass(frozen=True)
class Option:
    """One layout and what it costs, or why it was rejected."""

    pp: int
    dp: int
    n_virtual: int
    n_microbatches: int
    schedule: ScheduleName
    activation_checkpointing: bool
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

    @property
    def ranks_per_stage(self) -> int:
        """The ranks of one stage: ``dp x fsdp x tp``."""
        return self.dp * self.fsdp * self.tp

    @property
    def batch_shards(self) -> int:
        """The ranks of a stage that take their own share of the batch: ``dp x fsdp``."""
        return self.dp * self.fsdp

    def describe(self) -> str:
        ckpt = " +ckpt" if self.activation_checkpointing else ""
        sharded = "".join(f" {name}={getattr(self, name)}" for name in ("fsdp", "tp") if getattr(self, name) > 1)
        return f"pp={self.pp} dp={self.dp}{sharded} m={self.n_microbatches} {self.schedule}{ckpt}"


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
            "virtual": best.n_virtual,
            "partition": list(best.partition.bounds),
            "schedule": best.schedule,
            **({"schedule_text": schedule_text} if schedule_text is not None else {}),
            "microbatches": best.n_microbatches,
            "batch_size": workload.global_batch,
            "optimizer": optimizer,
            "activation_checkpointing": best.activation_checkpointing,
            "predicted": {
                "step_time": best.step_time,
                "bubble": best.bubble,
                "rank_memory": list(best.rank_memory),
                "rank_activation": list(best.rank_activation),
            },
        }
        return json.dumps(sectioned(fields), indent=1)
