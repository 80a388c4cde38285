"""What travels between stages: a tensor or a tuple of tensors, and its layout (each tensor's metadata)."""

from __future__ import annotations

import math
from typing import TypeAlias

import torch

from stagewise.comm.meta import TensorMeta

Payload: TypeAlias = torch.Tensor | tuple[torch.Tensor, ...]
"""What travels between stages: a tensor or a tuple of tensors."""


def as_tensors(payload: object) -> tuple[tuple[torch.Tensor, ...], bool]:
    """The tensors of a payload and whether it was a tuple; anything else is a TypeError."""
    if isinstance(payload, torch.Tensor):
        return (payload,), False
    if isinstance(payload, tuple) and payload and all(isinstance(t, torch.Tensor) for t in payload):
        return payload, True
    kinds = [type(v).__name__ for v in payload] if isinstance(payload, (tuple, list)) else type(payload).__name__
    raise TypeError(
        f"a payload between stages must be a tensor or a non-empty tuple of tensors, got {kinds}; "
        "pass other values (ints, strings, None) to every stage some other way, or make them tensors"
    )


PayloadLayout: TypeAlias = tuple[bool, tuple[TensorMeta, ...]]
"""Whether a payload is a tuple, and each tensor's metadata."""


def has_bytes(layout: PayloadLayout) -> bool:
    """Whether a payload of this layout has data to receive: without, only a control word can say it arrived."""
    return any(math.prod(m.shape) for m in layout[1])
