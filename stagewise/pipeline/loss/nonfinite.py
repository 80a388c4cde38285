"""What a step does with a NaN or infinite loss: raise naming where, or skip it without losing earlier gradients."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from stagewise.errors import StagewiseError
from stagewise.pipeline.config import NonFinite

log = logging.getLogger(__name__)


class NonFiniteLossError(StagewiseError, FloatingPointError):
    """The loss of a step was NaN or infinite; the message names the step and the first bad micro-batch."""


def first_non_finite(losses: list[torch.Tensor]) -> int:
    """The index of the first loss that is NaN or infinite, or -1; one device sync for all of them."""
    if not losses:
        return -1
    finite = torch.stack([loss.reshape(()) for loss in losses]).isfinite()
    return -1 if bool(finite.all()) else int((~finite).nonzero()[0])


@dataclass
class EarlierGradients:
    """Copies of the gradients accumulated over earlier steps, to restore if a step is skipped."""

    kept: list[tuple[nn.Parameter, torch.Tensor]]

    @classmethod
    def copy(cls, params: Iterable[nn.Parameter]) -> EarlierGradients:
        """Copy each parameter's gradient (a copy: the step accumulates into ``.grad`` in place)."""
        return cls([(p, p.grad.detach().clone()) for p in params if p.grad is not None])

    def restore(self, params: Iterable[nn.Parameter]) -> None:
        """Drop the step's gradients and put the earlier ones back (None where there were none)."""
        for param in params:
            param.grad = None
        for param, grad in self.kept:
            param.grad = grad


def skipped_step(
    loss: torch.Tensor,
    policy: NonFinite,
    *,
    where: str,
    earlier: EarlierGradients | None,
    params: Iterable[nn.Parameter],
) -> bool:
    """Whether a step whose global loss is ``loss`` is skipped: False when the loss is finite. When it is not,
    ``policy`` "raise" raises :class:`NonFiniteLossError` naming ``where`` (the step and first bad micro-batch);
    "skip" logs it, drops the step's gradients and puts back the ``earlier`` ones (copied at the step's start)."""
    if bool(torch.isfinite(loss)):
        return False
    message = f"the loss is {float(loss)} {where}"
    if policy == "raise":
        raise NonFiniteLossError(
            f"{message}; lower the learning rate, check the data, or pass "
            "PipelineOptions(loss=Loss(nonfinite='skip')) to drop such steps"
        )
    log.warning("%s: skipping the step (its gradients are dropped)", message)
    if earlier is None:
        raise ValueError("skipping a step needs the gradients copied at its start (EarlierGradients.copy)")
    earlier.restore(params)
    return True
