"""Split a global batch into micro-batches along dim 0, and weigh their losses so they add up to the batch's."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from stagewise.comm.payload import Payload, as_tensors
from stagewise.pipeline.config import LossFn, LossReduction


def scalar_loss(loss_fn: LossFn, output: Payload, target: Payload) -> torch.Tensor:
    """``loss_fn(output, target)``, refused unless it is a 0-dim tensor."""
    loss = loss_fn(output, target)
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        got = f"shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise ValueError(f"loss_fn must return a scalar tensor, got {got}; reduce it over the micro-batch")
    return loss


@dataclass(frozen=True)
class Microbatches:
    """A batch cut into ``len(parts)`` micro-batches, with each one's weight in the total loss."""

    parts: tuple[Payload, ...]
    sizes: tuple[int, ...]
    """Samples in each micro-batch; they differ by at most one."""
    weights: tuple[float, ...]
    """Factor of each micro-batch's loss: ``size / batch`` for a mean loss, 1 for a sum, and for a token mean
    1 / :attr:`tokens` (:func:`stagewise.pipeline.loss.tokens.per_token`; 1 until then)."""
    tokens: int = -1
    """For a token mean, the valid target tokens of the global batch, by which each summed loss is divided; else -1."""


def batch_size(payload: Payload, what: str) -> int:
    tensors, _ = as_tensors(payload)
    sizes = {t.shape[0] if t.dim() else None for t in tensors}
    if None in sizes or len(sizes) != 1:
        shapes = [tuple(t.shape) for t in tensors]
        raise ValueError(f"the {what} tensors must share their first (batch) dimension, got shapes {shapes}")
    (size,) = sizes
    assert size is not None
    return int(size)


def split(payload: Payload, n: int, *, what: str, reduction: LossReduction = "mean") -> Microbatches:
    """Cut ``payload`` into ``n`` micro-batches along dim 0 (``torch.tensor_split``: sizes differ by at most 1)."""
    total = batch_size(payload, what)
    if n > total:
        raise ValueError(
            f"n_microbatches={n} is more than the batch of {total} {what}; "
            f"use at most {total} micro-batches or a larger batch"
        )
    tensors, is_tuple = as_tensors(payload)
    pieces = [torch.tensor_split(t, n) for t in tensors]
    parts: list[Payload] = [tuple(p[i] for p in pieces) if is_tuple else pieces[0][i] for i in range(n)]
    sizes = tuple(int(p[0].shape[0]) for p in zip(*pieces, strict=True))
    weights = tuple(s / total if reduction == "mean" else 1.0 for s in sizes)  # a token mean's: per_token()
    return Microbatches(tuple(parts), sizes, weights)


def concat(parts: Sequence[Payload]) -> Payload:
    """Join micro-batch outputs back into one batch along dim 0; 0-dim outputs are stacked, one per micro-batch."""
    first, is_tuple = as_tensors(parts[0])
    columns = [[as_tensors(p)[0][i] for p in parts] for i in range(len(first))]
    joined = tuple(torch.stack(c) if all(t.dim() == 0 for t in c) else torch.cat(c) for c in columns)
    return joined if is_tuple else joined[0]
