"""Tensor metadata (dtype, shape, requires-grad) encoded as small integer tensors, never pickled."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

# Stable wire codes; append only, never reorder.
DTYPES: tuple[torch.dtype, ...] = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.complex64,
    torch.complex128,
)
_CODE = {dtype: code for code, dtype in enumerate(DTYPES)}


@dataclass(frozen=True)
class TensorMeta:
    """What a receiver needs to allocate one tensor of a payload."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    requires_grad: bool
    """True when the sender's tensor takes part in autograd; only floating tensors can."""

    @staticmethod
    def of(tensor: torch.Tensor) -> TensorMeta:
        if tensor.dtype not in _CODE:
            raise TypeError(f"cannot send a tensor of dtype {tensor.dtype}; supported: {[str(d) for d in DTYPES]}")
        grad = tensor.requires_grad and (tensor.is_floating_point() or tensor.is_complex())
        return TensorMeta(tensor.dtype, tuple(tensor.shape), grad)

    def empty(self, device: torch.device) -> torch.Tensor:
        """A receive buffer for this tensor."""
        return torch.empty(self.shape, dtype=self.dtype, device=device)


def encode(metas: Sequence[TensorMeta], *, is_tuple: bool) -> torch.Tensor:
    """``[is tuple, count, (dtype code, requires grad, ndim, *shape) per tensor]`` as an int64 tensor."""
    words = [int(is_tuple), len(metas)]
    for m in metas:
        words += [_CODE[m.dtype], int(m.requires_grad), len(m.shape), *m.shape]
    return torch.tensor(words, dtype=torch.int64)


def decode(words: torch.Tensor) -> tuple[bool, tuple[TensorMeta, ...]]:
    """The inverse of :func:`encode`: whether the payload is a tuple, and its tensors' metadata."""
    values = words.tolist()
    is_tuple, count, i = bool(values[0]), values[1], 2
    metas = []
    for _ in range(count):
        code, grad, ndim = values[i : i + 3]
        shape = tuple(values[i + 3 : i + 3 + ndim])
        metas.append(TensorMeta(DTYPES[code], shape, bool(grad)))
        i += 3 + ndim
    if i != len(values):
        raise ValueError(f"malformed tensor metadata: {len(values)} words, {i} used")
    return is_tuple, tuple(metas)
