"""What the tensor-parallel plan that ``train`` applies makes each layer do: whether it splits, and its collectives
in one micro-batch (what they cost is :mod:`stagewise.plan.tensor_parallel`'s)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from stagewise.partition import Layer
from stagewise.pipeline import TensorParallelPlan

if TYPE_CHECKING:  # DTensor is loaded where a plan is costed, not to import the planner
    from torch.distributed.tensor.parallel import ParallelStyle


@dataclass(frozen=True)
class LayerTraffic:
    """One layer under tensor parallelism: whether it splits, and its collectives per micro-batch."""

    split: bool
    """Whether its parameters, compute and most of its activations divide by ``tp``."""
    forward_all_reduces: int = 0
    """All-reduces of its output in the forward (a row-wise split's partial sums)."""
    backward_all_reduces: int = 0
    """All-reduces of its input's gradient in the backward (a column-wise split of a whole input)."""
    forward_all_gathers: int = 0
    """All-gathers of its output in the forward (a column-wise split whose output is made whole: the logits)."""


def _whole(layouts: object) -> bool:
    from torch.distributed.tensor import Replicate

    placements = layouts if isinstance(layouts, tuple) else (layouts,)
    return all(isinstance(p, Replicate) for p in placements)


def _of(styles: Iterable[ParallelStyle]) -> LayerTraffic:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    forward = backward = gathers = 0
    for style in styles:
        inputs = getattr(style, "input_layouts", None)
        outputs = getattr(style, "output_layouts", None)
        if isinstance(style, RowwiseParallel) and _whole(outputs):
            forward += 1  # partial sums made whole
        if isinstance(style, ColwiseParallel):
            if _whole(inputs):
                backward += 1  # the whole input's gradient, summed over the ranks
            if _whole(outputs):
                gathers += 1
        elif not isinstance(style, RowwiseParallel | ColwiseParallel):
            raise ValueError(f"the planner cannot cost the tensor-parallel style {type(style).__name__}")
    return LayerTraffic(True, forward, backward, gathers)


def layer_traffic(layers: Sequence[Layer], plan: TensorParallelPlan, tp: int) -> tuple[LayerTraffic, ...] | str:
    """Each layer's :class:`LayerTraffic` under ``plan`` over ``tp`` ranks, or why ``plan`` cannot split them."""
    out = []
    for layer in layers:
        try:
            styles = plan(layer.name, layer.module, tp)
        except ValueError as err:
            return str(err)
        if not styles:
            out.append(LayerTraffic(False))
            continue
        many = styles.values() if isinstance(styles, Mapping) else (styles,)
        out.append(_of(many))
    return tuple(out)
