"""Tensor parallelism inside stages: each layer split over the mesh's ``tp`` ranks by a plan (parallelize_module)."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module

from stagewise.comm import PipelineMesh
from stagewise.partition import Layer
from stagewise.partition.layers import SharedParameter
from stagewise.partition.segment import Segment
from stagewise.pipeline.config import TensorParallelPlan
from stagewise.pipeline.stage.module import StageModule
from stagewise.pipeline.stage.retie import retie

log = logging.getLogger(__name__)


def parallelize(
    modules: Sequence[nn.Module], names: Sequence[str], mesh: DeviceMesh, plan: TensorParallelPlan | None
) -> list[str]:
    """Split each of ``modules`` (named ``names``) over the 1-D ``mesh`` as ``plan`` says; returns the names of
    those split. Refuses a captured graph's layers (their ops are called by the graph, not through the modules
    the styles hook) and a missing plan."""
    if plan is None:
        raise ValueError(
            f"the mesh has tp={mesh.size()} but no tensor-parallel plan was given; pass "
            "PipelineOptions(tensor_parallel=plan), e.g. stagewise.models.gpt_parallel.plan for stagewise's GPT"
        )
    tp = mesh.size()
    split = []
    for module, name in zip(modules, names, strict=True):
        if isinstance(module, Segment):
            raise ValueError(
                f"layer {name} is a captured graph: tensor parallelism splits modules as they are called, and a "
                "captured model's graph calls its ops directly; train it with tp=1 (fsdp shards it instead)"
            )
        styles = plan(name, module, tp)
        if not styles:
            continue
        parallelize_module(module, mesh, styles if isinstance(styles, ParallelStyle) else dict(styles))
        split.append(name)
    return split


def placed_like_parameters(params: Iterable[nn.Parameter]) -> None:
    """Give each DTensor gradient its parameter's placements: DTensor's backward of some ops (a row-split
    embedding's) leaves a whole (replicated) gradient for a sharded parameter, which the optimizer, tied copies and
    clipping take shard by shard. Replicated to sharded is a slice: no communication."""
    for param in params:
        grad = param.grad
        if isinstance(param, DTensor) and isinstance(grad, DTensor) and grad.placements != param.placements:
            param.grad = grad.redistribute(param.device_mesh, param.placements)


def split_stages(
    stages: Mapping[int, StageModule],
    layers: Sequence[Layer],
    shared: Sequence[SharedParameter],
    mesh: PipelineMesh,
    plan: TensorParallelPlan | None,
) -> list[str]:
    """Split this rank's ``stages`` over ``mesh``'s ``tp`` ranks as ``plan`` says (see :func:`parallelize`), and
    tie again the layers that share a parameter (a style makes a parameter of its own); returns the layers split."""
    split = []
    for stage in stages.values():
        split += parallelize(list(stage.layers), stage.names, mesh.device_mesh["tp"], plan)
    held = {stage.first + offset for stage in stages.values() for offset in range(len(stage.names))}
    retie(layers, shared, held)
    log.info("layers %s are split over %d tp ranks", split, mesh.layout.tp)
    return split
