"""BackwardPlan: what one forward of a stage records for its backward, and how that backward accumulates."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from stagewise.pipeline.backward.fusion import WeightGradientStore
from stagewise.pipeline.backward.split import WeightUse


@dataclass(frozen=True)
class BackwardPlan:
    """How the backward of one forward of a stage will run, set up by that forward (:meth:`StageModule.run`).

    The default records nothing and fuses nothing: autograd accumulates every gradient.
    """

    owners: list[WeightUse] | None = None
    """Record every use of parameters here, as the layers run: a split backward's W starts from them (see
    :class:`~stagewise.pipeline.backward.split.WeightUse`); None: record none."""
    joint: bool = False
    """With ``owners``: W runs one backward over all of them (see :attr:`ParameterUses.cut_all`), as the
    micro-batch whose backward DDP synchronises needs (its hooks fire once)."""
    fused: bool = False
    """The backward accumulates the gradients of the stage's linear weights of at least its fusion threshold
    itself (see :class:`~stagewise.pipeline.backward.fusion.FusedWeightGradients`), not through autograd."""
    store: WeightGradientStore | None = None
    """With ``fused``: where the backward leaves those gradients until the store's ``flush``; None: straight into
    ``.grad``."""
    pooled: bool = False
    """With ``fused``: the threshold is the pooled one (``WeightGradientFusion.min_pooled_elements``)."""
    anchor: torch.Tensor | None = None
    """With ``fused``: an input of every fused op, whose gradient request runs all their backwards (zero-bubble's
    I fills the micro-batch's store so)."""
