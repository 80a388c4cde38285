"""FSDP inside stages: each stage one ``fully_shard`` unit, gathered once per step or around each of its actions.

FSDP2's own hooks gather a module's parameters in its forward and reduce-scatter its gradients in its
backward, once per call: once per micro-batch in a pipeline. Here the executor calls each stage's layers past
the stage module's hooks (:meth:`StageModule.run`), and :class:`ShardedStages` drives FSDP itself, as
:attr:`FullySharded.gather` says.

``gather="step"``: :meth:`~ShardedStages.gather` all-gathers every stage's parameters before the step's first
action, autograd accumulates every micro-batch's gradient into the whole (unsharded) parameters, whatever the
schedule (a split backward's W included), and :meth:`~ShardedStages.reduce` reduce-scatters them once at the
step's end, then frees the whole parameters. The cost: during a step a rank holds its stages' whole parameters
and gradients (as without FSDP); between steps, ``1/fsdp`` of them and of the optimizer state.

``gather="micro-batch"`` (ZeRO-3 inside the pipeline): the schedule is data, so each pass over a rank's actions
knows the next one (:class:`ActionGathers`). A stage's parameters are gathered before its action and stay whole
while the rank's next actions are the same stage's (freeing them there would only gather them again, at no
lower peak: the action needs them whole); after the last of such a run they are freed, and the next action's
stage's gather is issued at once (``unshard(async_op=True)``), so it overlaps the wait for that action's input
and whatever the rank does in between, and at most one stage per rank is whole at a time. Issuing it before the
current action instead (overlapping its compute) would hold two stages whole, which for a rank of two stages is
the "step" peak again. After each action that may produce parameter gradients (B, I, W) FSDP's post-backward
reduce-scatters them and adds them to the sharded ``.grad``, and frees the whole gradients: a rank never holds a
stage's whole gradients beyond the action that made them. The alternative, gradients kept whole until the
step's end (one reduce-scatter per step, parameters gathered per action), would keep every stage's whole
gradients, a stage's whole parameters' worth each, for the whole step, and save no gradient memory; the
per-action reduce-scatter costs ``m`` reduce-scatters per stage and step instead of one, and under HSDP as many
all-reduces across the replicas. Autograd's saved parameters survive a free and a gather between a forward and
its backward: FSDP frees the storage of the whole parameters and gathers into the same tensors again (the
same objects, their storage re-allocated), so a backward reads the parameters its forward saw.

``offload=True`` adds FSDP's ``CPUOffloadPolicy``: the sharded parameters, their gradients and so the optimizer
state live in host memory (pinned where the mesh's device is an accelerator), copied to the device for each
all-gather; on a CPU mesh nothing moves, and the option runs FSDP's offloading code unpinned.

Private names of torch relied on (as ``torch.distributed.pipelining`` relies on them for the same purpose):
``FSDPModule._get_fsdp_state``, its ``_lazy_init``, ``_fsdp_param_groups``, ``FSDPParamGroup.post_backward``,
``FSDPParamGroup.fsdp_params`` and ``FSDPParam._unsharded_param`` (to drop a failed action's whole gradients),
and ``_root_post_backward_final_callback``.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor

from stagewise.comm import Layout, PipelineMesh
from stagewise.comm.errors import named_collective
from stagewise.partition.layers import SharedParameter
from stagewise.pipeline.config import FullySharded
from stagewise.pipeline.stage.module import StageModule
from stagewise.schedule.actions import Action, Kind, Schedule

log = logging.getLogger(__name__)


def fully_sharded(given: FullySharded | Literal["auto"], layout: Layout) -> FullySharded | None:
    """How stages are sharded: ``given`` (``PipelineOptions.fully_sharded``) where it is a FullySharded; for
    "auto", ``FullySharded()`` where the mesh shards (``fsdp > 1``) or replicates tensor-parallel stages (``tp > 1``
    with ``dp > 1``: DDP does not take DTensors, FSDP's HSDP over a shard of one does the replicas' all-reduce);
    else None (not sharded)."""
    if given != "auto":
        return given
    return FullySharded() if layout.fsdp > 1 or (layout.tp > 1 and layout.dp > 1) else None


def offload_policy(config: FullySharded, device_type: str) -> OffloadPolicy:
    """FSDP's offload policy for ``config`` on a mesh of ``device_type``: host memory for the shards with
    ``offload`` (pinned unless the device is the CPU, where pinning needs an accelerator), else none."""
    if not config.offload:
        return OffloadPolicy()
    return CPUOffloadPolicy(pin_memory=device_type != "cpu")


def _whole_bytes(stage: StageModule, dtype: torch.dtype | None) -> int:
    """The bytes of ``stage``'s whole parameters on this rank, gathered in ``dtype`` (None: their own)."""
    total = 0
    for param in stage.parameters():
        mine = param.to_local() if isinstance(param, DTensor) else param  # a tensor-parallel split stays split
        total += mine.numel() * (dtype or param.dtype).itemsize
    return total


def refuse_ties_within_a_rank(shared: Sequence[SharedParameter], bounds: Sequence[int], schedule: Schedule) -> None:
    """Refuse tied weights that two stages of one rank use (the V placement of zbv puts the first and the last
    stage on rank 0): each stage is an FSDP unit of its own, which would shard the one tensor twice and train two
    copies apart. Every rank decides it alike, from the whole model's ties, before any is sharded.

    Raises:
        ValueError: naming the stages, the rank, the parameter and the ways out.
    """
    for tie in shared:
        stages = sorted({bisect.bisect_right(bounds, i) - 1 for i in tie.indices})
        held: dict[int, list[int]] = {}
        for stage in stages:
            held.setdefault(schedule.rank_of(stage), []).append(stage)
        for rank, mine in held.items():
            if len(mine) > 1:
                raise ValueError(
                    f"stages {mine[0]} and {mine[1]} run on pipeline rank {rank} and share the parameter "
                    f"{tie.names[0]!r} (tied weights), which FSDP would shard as two units and train as two copies; "
                    "place the layers that share it on different ranks (a round-robin schedule such as "
                    "interleaved-1f1b, not the V of zbv or dualpipev), untie them, or train without sharding"
                )


class ShardedStages:
    """This rank's stages, each wrapped by ``fully_shard`` over ``mesh`` (1-D: FSDP; 2-D ``("dp", "fsdp")``:
    HSDP, sharded within a replica and all-reduced across replicas), gathered as ``config.gather`` says.

    :attr:`whole` says which stages' whole parameters are allocated at the moment, and :attr:`peak_bytes` the
    most bytes of whole parameters the rank held at once (see :meth:`reset_peak`)."""

    def __init__(
        self,
        stages: dict[int, StageModule],
        mesh: DeviceMesh,
        config: FullySharded,
        *,
        timeout: float,
        ignored: set[nn.Parameter] | None = None,
    ) -> None:
        self.config = config
        self.timeout = timeout
        self.mesh = mesh
        policy = MixedPrecisionPolicy(param_dtype=config.param_dtype, reduce_dtype=config.reduce_dtype)
        offload = offload_policy(config, mesh.device_type)
        self.stages = stages
        self.units: dict[int, FSDPModule] = {}
        self.sizes: dict[int, int] = {}
        """Bytes of each sharded stage's whole parameters on this rank (in ``param_dtype`` where given)."""
        for s, stage in stages.items():
            if not any(p.requires_grad for p in stage.parameters()):
                continue  # nothing to shard or to reduce
            self.sizes[s] = _whole_bytes(stage, config.param_dtype)
            try:
                unit = fully_shard(
                    stage, mesh=mesh, reshard_after_forward=False, mp_policy=policy, offload_policy=offload,
                    ignored_params=ignored,
                )  # fmt: skip
                unit._get_fsdp_state()._lazy_init()  # as its first forward would: the executor calls past its hooks
            except (AssertionError, RuntimeError, ValueError, TypeError) as err:
                dtypes = sorted({str(p.dtype).removeprefix("torch.") for p in stage.parameters()})
                cause = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
                raise ValueError(
                    f"stage {s} (layers {stage.names[0]} .. {stage.names[-1]}, parameters of dtypes {dtypes}) cannot "
                    f"be sharded by fully_shard: {cause}; give its layers parameters FSDP can flatten together (one "
                    "floating dtype, no parameter shared with another stage's layers here), or train with fsdp=1"
                ) from err
            self.units[s] = unit
            stage.compute_dtype = config.param_dtype
        self.gathered = False
        """Under ``gather="step"``: whether the stages' whole parameters are allocated (between :meth:`gather` and
        the end of the step)."""
        self.whole: set[int] = set()
        """The stages whose whole parameters are allocated now (gathered, or being gathered)."""
        self.peak_bytes = 0
        """The most bytes of whole parameters this rank held at once since it was built or :meth:`reset_peak`."""
        self._pending: dict[int, object] = {}
        """Gathers issued ahead (``unshard(async_op=True)``'s handles), by stage."""
        log.info(
            "stages %s are sharded over %d ranks (%s), gathered per %s%s",
            list(self.units), mesh.size(), mesh.mesh_dim_names, config.gather,
            ", shards in host memory" if config.offload else "",
        )  # fmt: skip

    @classmethod
    def over(
        cls,
        stages: dict[int, StageModule],
        mesh: PipelineMesh,
        config: FullySharded,
        *,
        ignored: set[nn.Parameter] | None = None,
    ) -> ShardedStages:
        """``stages`` sharded over ``mesh``'s ``fsdp`` ranks (HSDP over ``("dp", "fsdp")`` where ``dp > 1``), every
        wait bounded by the mesh's timeout; the ``ignored`` parameters (split experts) stay as they are."""
        names = ("dp", "fsdp") if mesh.layout.dp > 1 else ("fsdp",)
        return cls(stages, mesh.device_mesh[names], config, timeout=mesh.timeout, ignored=ignored)

    @property
    def per_action(self) -> bool:
        """Whether stages are gathered around their actions (``gather="micro-batch"``), not once per step."""
        return self.config.gather == "micro-batch"

    @property
    def whole_bytes(self) -> int:
        """Bytes of the whole parameters allocated now (the stages of :attr:`whole`)."""
        return sum(self.sizes[s] for s in self.whole)

    def reset_peak(self) -> None:
        """Start :attr:`peak_bytes` again from what is whole now."""
        self.peak_bytes = self.whole_bytes

    def _mark_whole(self, stage: int) -> None:
        self.whole.add(stage)
        self.peak_bytes = max(self.peak_bytes, self.whole_bytes)

    def _peer(self) -> int:
        rank = dist.get_rank()
        return next((r for r in self.mesh.mesh.flatten().tolist() if r != rank), rank)

    @contextmanager
    def _named(self, what: str) -> Iterator[None]:
        with named_collective(rank=dist.get_rank(), peer=self._peer(), what=what, timeout=self.timeout):
            yield

    # --- gather="step" ----------------------------------------------------------------------------

    def gather(self) -> None:
        """All-gather every stage's parameters (once per step), which then stay whole until :meth:`reduce` or
        :meth:`release`; gradients accumulate over the micro-batches without reduction."""
        if self.gathered:
            return
        with self._named("FSDP's all-gather of the stages' parameters"):
            for s, unit in self.units.items():
                _last_backward(unit, False)
                unit.unshard()
                self._mark_whole(s)
        self.gathered = True

    def reduce(self) -> None:
        """Reduce-scatter each stage's accumulated gradients into its sharded ``.grad`` (averaged over the
        ``dp x fsdp`` ranks), then free the whole parameters and gradients: once per step, after every backward.
        Under ``gather="micro-batch"``, where each backward reduced its own, only FSDP's end of a backward."""
        if self.per_action:
            self._finish()
            return
        if not self.gathered:
            return
        with self._named("FSDP's reduce-scatter of the stages' gradients"):
            for unit in self.units.values():
                _last_backward(unit, True)
                state = unit._get_fsdp_state()
                for group in state._fsdp_param_groups:
                    group.post_backward()
                state._root_post_backward_final_callback()
        self.gathered = False
        self.whole.clear()

    @contextmanager
    def gathering(self, *, reduce: bool) -> Iterator[None]:
        """Within, the stages hold their whole parameters (:meth:`gather`; under ``gather="micro-batch"`` the
        executor gathers around each action, see :meth:`around`); on leaving, their gradients are
        reduce-scattered (``reduce``, a training step's end: :meth:`reduce`) or dropped (a forward-only pass, or a
        failure: :meth:`release`)."""
        if not self.per_action:
            self.gather()
        try:
            yield
        except BaseException:
            self.release()
            raise
        if reduce:
            self.reduce()
        else:
            self.release()

    def release(self) -> None:
        """Free the whole parameters without reducing anything: after a forward-only pass, or a failed step
        (whose whole gradients are dropped; under ``gather="micro-batch"`` the sharded ``.grad`` keeps what the
        step's completed backwards reduced, as an unsharded pipeline's ``.grad`` keeps their sum)."""
        if self.per_action:
            self._wait_pending()
            for unit in self.units.values():
                for group in unit._get_fsdp_state()._fsdp_param_groups:
                    for fsdp_param in group.fsdp_params:
                        whole = getattr(fsdp_param, "_unsharded_param", None)
                        if whole is not None:
                            whole.grad = None
            self._finish()
            return
        if not self.gathered:
            return
        for s, unit in self.units.items():
            for param in self.stages[s].parameters():  # the whole ones, while gathered: their gradients are the step's
                param.grad = None
            unit.reshard()
        self.gathered = False
        self.whole.clear()

    # --- gather="micro-batch" ---------------------------------------------------------------------

    def around(self, actions: Sequence[Action], *, training: bool) -> ActionGathers | None:
        """What gathers and frees the stages around each of ``actions`` (one pass over a rank's actions) under
        ``gather="micro-batch"``; None under "step", where :meth:`gathering` holds them whole for the pass."""
        if not self.per_action:
            return None
        for unit in self.units.values():
            unit.set_requires_gradient_sync(True)  # every backward reduce-scatters (and all-reduces, under HSDP)
            unit.set_reshard_after_backward(False)  # the next action may be the same stage's: ActionGathers frees
            unit.set_is_last_backward(False)
        return ActionGathers(self, [a.stage for a in actions], [a.kind for a in actions], training=training)

    def prefetch(self, stage: int) -> None:
        """Issue the all-gather of ``stage``'s parameters without waiting for it (see :meth:`whole_now`)."""
        unit = self.units.get(stage)
        if unit is None or stage in self.whole:
            return
        with self._named(f"FSDP's all-gather of stage {stage}'s parameters"):
            self._pending[stage] = unit.unshard(async_op=True)
        self._mark_whole(stage)

    def whole_now(self, stage: int) -> None:
        """Make ``stage``'s whole parameters usable: wait for its gather issued ahead, or gather it now."""
        unit = self.units.get(stage)
        if unit is None:
            return
        with self._named(f"FSDP's all-gather of stage {stage}'s parameters"):
            handle = self._pending.pop(stage, None)
            if handle is not None:
                handle.wait()  # type: ignore[attr-defined]
            elif stage not in self.whole:
                unit.unshard()
        self._mark_whole(stage)

    def reduce_action(self, stage: int) -> None:
        """Reduce-scatter the gradients ``stage``'s last action left in its whole parameters into its sharded
        ``.grad`` (added to what is there), and free them; nothing where the action left none."""
        unit = self.units.get(stage)
        if unit is None:
            return
        with self._named(f"FSDP's reduce-scatter of stage {stage}'s gradients"):
            for group in unit._get_fsdp_state()._fsdp_param_groups:
                group.post_backward()

    def free(self, stage: int) -> None:
        """Free ``stage``'s whole parameters (their storage; the tensors stay, to be gathered into again)."""
        unit = self.units.get(stage)
        if unit is None:
            return
        unit.reshard()
        self.whole.discard(stage)

    def _wait_pending(self) -> None:
        """Wait for every gather issued ahead (a failed pass's: its peers issued them too)."""
        for stage, handle in list(self._pending.items()):
            del self._pending[stage]
            handle.wait()  # type: ignore[attr-defined]

    def _finish(self) -> None:
        """End FSDP's backward of every stage (its states back to idle, its reduce-scatter buffers released;
        nothing left to reduce) and free every stage's whole parameters."""
        self._wait_pending()
        for s, unit in self.units.items():
            _last_backward(unit, True)
            unit._get_fsdp_state()._root_post_backward_final_callback()
            self.free(s)


class ActionGathers:
    """One pass over a rank's actions under ``gather="micro-batch"``: :meth:`before` and :meth:`after` each
    action, as the module's docstring says (a stage whole through a run of its actions, the next run's stage
    gathered as soon as the last is freed, gradients reduce-scattered after each backward)."""

    def __init__(self, sharded: ShardedStages, stages: list[int], kinds: list[Kind], *, training: bool) -> None:
        self.sharded = sharded
        self.stages = stages
        """The stage of each action of the pass."""
        self.kinds = kinds
        self.training = training
        if stages:
            sharded.prefetch(stages[0])  # overlaps the wait for the first action's input

    def before(self, i: int) -> None:
        """Action ``i``'s stage whole, its gather waited for."""
        self.sharded.whole_now(self.stages[i])

    def after(self, i: int) -> None:
        """Action ``i``'s gradients reduce-scattered (in training, after a backward); its stage freed unless the
        next action is the same stage's, and then the next action's stage's gather issued."""
        stage = self.stages[i]
        if self.training and self.kinds[i] is not Kind.F:
            self.sharded.reduce_action(stage)
        following = self.stages[i + 1] if i + 1 < len(self.stages) else None
        if following == stage:
            return
        self.sharded.free(stage)
        if following is not None:
            self.sharded.prefetch(following)


def _last_backward(unit: FSDPModule, last: bool) -> None:
    """Whether ``unit``'s next post-backward is the step's: reduce-scatter the gradients and free the whole
    parameters (True), or keep both (False)."""
    unit.set_requires_gradient_sync(last)
    unit.set_reshard_after_backward(last)
    unit.set_is_last_backward(last)
