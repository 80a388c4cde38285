"""Case: one pipeline training run of a test chain, shared by the equivalence and data-parallel tests."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from stagewise.pipeline import LossReduction, WeightGradientFusion
from stagewise.schedule import Schedule
from support.chains import Chain

EVERY = WeightGradientFusion.every()
"""Fuse every linear weight's gradient, however small (the test chains' are)."""


@dataclass(frozen=True)
class Case:
    """A chain split at ``bounds`` and trained with ``schedule``: what a test runs and compares with the unsplit
    chain."""

    chain: Chain
    bounds: tuple[int, ...]
    """Stage boundaries over the chain's layers."""
    schedule: str | Schedule
    n_virtual: int
    """Stages per rank."""
    n_microbatches: int
    global_batch: int
    """Samples per step over all replicas."""
    fusion: WeightGradientFusion = EVERY
    """How linear weight gradients are accumulated: inside their GEMMs, pooled, or by autograd (``off()``)."""
    over_gloo: bool = False
    """Exchange through the transport's own gloo group, as ranks on other hosts do, rather than shared memory."""
    clip: bool = False
    """Clip the gradients' global norm after each step."""
    reduction: LossReduction = "mean"
    """How the loss reduces over a batch."""

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The mean squared error, reduced as :attr:`reduction` says."""
        return F.mse_loss(output, target, reduction=self.reduction)
