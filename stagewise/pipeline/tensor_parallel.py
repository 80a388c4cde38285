"""Tensor parallelism inside stages: each layer's modules split over the mesh's ``tp`` ranks by a plan, with
DTensor's ``parallelize_module``, from outside the model."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module

from stagewise.partition import Segment

log = logging.getLogger(__name__)

TensorParallelPlan = Callable[[nn.Module, int], Mapping[str, ParallelStyle] | None]
"""``plan(module, tp)``: how to split one layer's ``module`` over ``tp`` ranks, as ``parallelize_module`` takes it
(submodule names relative to the layer, to torch's ``ColwiseParallel``, ``RowwiseParallel``, ...); None leaves the
layer whole on every ``tp`` rank (replicated: each computes the same). A plan that cannot split the layer over
``tp`` ranks raises ``ValueError`` saying what would fit. The layers' outputs must be whole (replicated) tensors,
as a row-wise split's are, since they travel to the next stage as they are."""


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
        styles = plan(module, tp)
        if not styles:
            continue
        parallelize_module(module, mesh, dict(styles))
        split.append(name)
    return split
