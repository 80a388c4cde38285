"""FSDP inside stages: each stage one ``fully_shard`` unit, gathered once per step and reduce-scattered once.

FSDP2's own hooks gather a module's parameters in its forward and reduce-scatter its gradients in its
backward, once per call: once per micro-batch in a pipeline. Here the executor calls each stage's layers past
the stage module's hooks (:meth:`StageModule.run`), and :class:`ShardedStages` drives FSDP itself:
:meth:`~ShardedStages.gather` all-gathers every stage's parameters before the step's first action, autograd
accumulates every micro-batch's gradient into the whole (unsharded) parameters, whatever the schedule (a split
backward's W included), and :meth:`~ShardedStages.reduce` reduce-scatters them once at the step's end, then
frees the whole parameters. The cost: during a step a rank holds its stages' whole parameters and gradients (as
without FSDP); between steps, ``1/fsdp`` of them and of the optimizer state.

Private names of torch relied on (as ``torch.distributed.pipelining`` relies on them for the same purpose):
``FSDPModule._get_fsdp_state``, its ``_lazy_init``, ``_fsdp_param_groups``, ``FSDPParamGroup.post_backward``
and ``_root_post_backward_final_callback``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Literal

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from stagewise.comm import Layout, PipelineMesh
from stagewise.comm.errors import named_collective
from stagewise.pipeline.config import FullySharded
from stagewise.pipeline.stage.module import StageModule

log = logging.getLogger(__name__)


def fully_sharded(given: FullySharded | Literal["auto"], layout: Layout) -> FullySharded | None:
    """How stages are sharded: ``given`` (``PipelineOptions.fully_sharded``) where it is a FullySharded; for
    "auto", ``FullySharded()`` where the mesh shards (``fsdp > 1``) or replicates tensor-parallel stages (``tp > 1``
    with ``dp > 1``: DDP does not take DTensors, FSDP's HSDP over a shard of one does the replicas' all-reduce);
    else None (not sharded)."""
    if given != "auto":
        return given
    return FullySharded() if layout.fsdp > 1 or (layout.tp > 1 and layout.dp > 1) else None


class ShardedStages:
    """This rank's stages, each wrapped by ``fully_shard`` over ``mesh`` (1-D: FSDP; 2-D ``("dp", "fsdp")``:
    HSDP, sharded within a replica and all-reduced across replicas)."""

    def __init__(
        self, stages: dict[int, StageModule], mesh: DeviceMesh, config: FullySharded, *, timeout: float
    ) -> None:
        self.config = config
        self.timeout = timeout
        self.mesh = mesh
        policy = MixedPrecisionPolicy(param_dtype=config.param_dtype, reduce_dtype=config.reduce_dtype)
        self.stages = stages
        self.units: dict[int, FSDPModule] = {}
        for s, stage in stages.items():
            if not any(p.requires_grad for p in stage.parameters()):
                continue  # nothing to shard or to reduce
            try:
                unit = fully_shard(stage, mesh=mesh, reshard_after_forward=False, mp_policy=policy)
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
        """Whether the stages' whole parameters are allocated (between :meth:`gather` and the end of the step)."""
        log.info("stages %s are sharded over %d ranks (%s)", list(self.units), mesh.size(), mesh.mesh_dim_names)

    @classmethod
    def over(cls, stages: dict[int, StageModule], mesh: PipelineMesh, config: FullySharded) -> ShardedStages:
        """``stages`` sharded over ``mesh``'s ``fsdp`` ranks (HSDP over ``("dp", "fsdp")`` where ``dp > 1``), every
        wait bounded by the mesh's timeout."""
        names = ("dp", "fsdp") if mesh.layout.dp > 1 else ("fsdp",)
        return cls(stages, mesh.device_mesh[names], config, timeout=mesh.timeout)

    def _peer(self) -> int:
        rank = dist.get_rank()
        return next((r for r in self.mesh.mesh.flatten().tolist() if r != rank), rank)

    @contextmanager
    def _named(self, what: str) -> Iterator[None]:
        with named_collective(rank=dist.get_rank(), peer=self._peer(), what=what, timeout=self.timeout):
            yield

    def gather(self) -> None:
        """All-gather every stage's parameters (once per step), which then stay whole until :meth:`reduce` or
        :meth:`release`; gradients accumulate over the micro-batches without reduction."""
        if self.gathered:
            return
        with self._named("FSDP's all-gather of the stages' parameters"):
            for unit in self.units.values():
                _last_backward(unit, False)
                unit.unshard()
        self.gathered = True

    def reduce(self) -> None:
        """Reduce-scatter each stage's accumulated gradients into its sharded ``.grad`` (averaged over the
        ``dp x fsdp`` ranks), then free the whole parameters and gradients: once per step, after every backward."""
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

    @contextmanager
    def gathering(self, *, reduce: bool) -> Iterator[None]:
        """Within, the stages hold their whole parameters (:meth:`gather`); on leaving, their gradients are
        reduce-scattered (``reduce``, a training step's end: :meth:`reduce`) or dropped (a forward-only pass, or a
        failure: :meth:`release`)."""
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
        (whose whole gradients are dropped)."""
        if not self.gathered:
            return
        for s, unit in self.units.items():
            for param in self.stages[s].parameters():  # the whole ones, while gathered: their gradients are the step's
                param.grad = None
            unit.reshard()
        self.gathered = False


def _last_backward(unit: FSDPModule, last: bool) -> None:
    """Whether ``unit``'s next post-backward is the step's: reduce-scatter the gradients and free the whole
    parameters (True), or keep both (False)."""
    unit.set_requires_gradient_sync(last)
    unit.set_reshard_after_backward(last)
    unit.set_is_last_backward(last)
