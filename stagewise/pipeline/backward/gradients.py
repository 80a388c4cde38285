"""The tensors of a payload that carry gradients, and the layout of the gradients a stage sends back for them."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from stagewise.comm.meta import TensorMeta
from stagewise.comm.payload import Payload, PayloadLayout, as_tensors


def grad_tensors(payload: object) -> list[torch.Tensor]:
    """The tensors of a payload that carry gradients."""
    if isinstance(payload, torch.Tensor):
        return [payload] if payload.requires_grad else []
    tensors, _ = as_tensors(payload)
    return [t for t in tensors if t.requires_grad]


def gradient_layout(output: object) -> PayloadLayout:
    """The layout of the gradients a stage gets back for ``output``: one per tensor that carries a gradient.

    With none, the next stage answers with an empty tensor (see ``_backward``).
    """
    tensors = grad_tensors(output)
    if not tensors:
        return (False, (TensorMeta(torch.float32, (0,), False),))
    return (len(tensors) > 1, tuple(TensorMeta(t.dtype, tuple(t.shape), False) for t in tensors))


def handed_over(payload: Payload) -> Payload:
    """A copy-free hand-over between two stages on one rank: detached, requiring grad where the source did."""
    tensors, is_tuple = as_tensors(payload)
    out = tuple(t.detach().requires_grad_(t.requires_grad) for t in tensors)
    return out if is_tuple else out[0]


def pack_gradients(grads: Sequence[torch.Tensor]) -> Payload:
    """One gradient as itself, several as a tuple: the form a payload's gradients travel in."""
    return grads[0] if len(grads) == 1 else tuple(grads)
