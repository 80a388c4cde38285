"""Tensor parallelism inside stages: each layer split over the mesh's ``tp`` ranks by a plan: a function of each
layer's module (parallelize_module), or a mapping of the unsplit model's paths to styles, which splits captured
graphs too (see :mod:`.captured_tensor_parallel`)."""

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
from stagewise.pipeline.config import PipelineOptions, TensorParallelPlan
from stagewise.pipeline.parallel.captured_tensor_parallel import SegmentSplit, check_ties, segment_split, split_segment
from stagewise.pipeline.parallel.tensor_plan import PathPlan, module_styles, parameter_names, path_plan
from stagewise.pipeline.stage.module import StageModule
from stagewise.pipeline.stage.retie import retie

log = logging.getLogger(__name__)


def _missing(mesh: DeviceMesh) -> ValueError:
    return ValueError(
        f"the mesh has tp={mesh.size()} but no tensor-parallel plan was given; pass "
        "PipelineOptions(tensor_parallel=plan), e.g. stagewise.models.gpt_parallel.plan for stagewise's GPT, or "
        "'model' for a Hugging Face model's own tp_plan"
    )


def parallelize(
    modules: Sequence[nn.Module], names: Sequence[str], mesh: DeviceMesh, plan: TensorParallelPlan | None
) -> list[str]:
    """Split each of ``modules`` (named ``names``) over the 1-D ``mesh`` as the function ``plan`` says; returns the
    names of those split. Refuses a captured graph's layers (their ops are called by the graph, not through the
    modules the styles hook: a mapping plan splits them) and a missing plan."""
    if plan is None:
        raise _missing(mesh)
    tp = mesh.size()
    split = []
    for module, name in zip(modules, names, strict=True):
        if isinstance(module, Segment):
            raise ValueError(
                f"layer {name} is a captured graph, which a function plan cannot split (it splits modules as they "
                "are called, and the graph calls its ops directly); pass PipelineOptions(tensor_parallel=...) a "
                "mapping of parameter or module paths to styles, or 'model' for a Hugging Face model's own tp_plan"
            )
        styles = plan(name, module, tp)
        if not styles:
            continue
        parallelize_module(module, mesh, styles if isinstance(styles, ParallelStyle) else dict(styles))
        split.append(name)
    return split


def _by_paths(
    stages: Mapping[int, StageModule],
    layers: Sequence[Layer],
    shared: Sequence[SharedParameter],
    plan: PathPlan,
    mesh: DeviceMesh,
) -> list[str]:
    """Split this rank's ``stages`` over the 1-D ``mesh`` as the path-keyed ``plan`` says: captured layers through
    DTensor (see :mod:`.captured_tensor_parallel`), modules by ``parallelize_module``. Every rank checks the plan
    against every layer first, so that all refuse it together."""
    tp = mesh.size()
    plan.check_names(parameter_names(layers))
    splits: dict[int, SegmentSplit] = {
        i: segment_split(layer.module, layer.name, plan, tp)
        for i, layer in enumerate(layers)
        if isinstance(layer.module, Segment)
    }
    check_ties(layers, shared, splits)
    styles = {i: module_styles(plan, layer) for i, layer in enumerate(layers) if i not in splits}
    split = []
    for stage in stages.values():
        for index in range(stage.first, stage.first + len(stage.names)):
            module = layers[index].module
            if isinstance(module, Segment):
                if splits[index].splits:
                    split_segment(module, splits[index], mesh)
                    split.append(layers[index].name)
            elif styles[index]:
                own = styles[index]
                parallelize_module(module, mesh, own.get("", own))
                split.append(layers[index].name)
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
    options: PipelineOptions,
    model: nn.Module,
) -> list[str]:
    """Split this rank's ``stages`` over ``mesh``'s ``tp`` ranks as ``options.tensor_parallel`` says (a function:
    see :func:`parallelize`; a mapping or "model", the Hugging Face ``model``'s own plan: see
    :mod:`.tensor_plan`), and tie again the layers that share a parameter (a style makes a parameter of its own);
    returns the layers split."""
    plan = options.tensor_parallel
    tp_mesh = mesh.device_mesh["tp"]
    if plan is None:
        raise _missing(tp_mesh)
    split = []
    if isinstance(plan, str | Mapping):
        split = _by_paths(stages, layers, shared, path_plan(plan, model), tp_mesh)
    else:
        for stage in stages.values():
            split += parallelize(list(stage.layers), stage.names, tp_mesh, plan)
    held = {stage.first + offset for stage in stages.values() for offset in range(len(stage.names))}
    retie(layers, shared, held)
    log.info("layers %s are split over %d tp ranks", split, mesh.layout.tp)
    return split
