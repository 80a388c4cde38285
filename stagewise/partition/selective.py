"""What selective activation checkpointing keeps of a layer's forward, and what it recomputes in backward."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import flop_registry

from stagewise.partition.attention import FLOP_FORMULAS

aten = torch.ops.aten

KEPT_OPS: frozenset[Any] = frozenset({aten.mm, aten.addmm, aten.bmm, aten.baddbmm})
"""The ops whose outputs selective checkpointing keeps, beside fused attention (every
``_scaled_dot_product_*attention*`` forward op): the matmuls, where a layer's FLOPs are."""


def is_kept(func: Any) -> bool:
    """Whether selective checkpointing keeps the output of the aten op ``func`` (an overload)."""
    packet = func.overloadpacket
    if packet in KEPT_OPS:
        return True
    name = packet.__name__
    return name.startswith("_scaled_dot_product") and "attention" in name and "backward" not in name


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _flops(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> int:
    """The FLOPs torch's counter gives ``func`` (0 for the ops it has no formula for: elementwise ones)."""
    formula = FLOP_FORMULAS.get(func) or flop_registry.get(func.overloadpacket)
    if formula is None:
        return 0
    return int(formula(*args, **kwargs, out_val=out))


def _made(args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """An op's tensor inputs, and the tensors it made (none for a view or an op in place)."""
    inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    given = {id(t.untyped_storage()) for t in inputs}
    made = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and id(t.untyped_storage()) not in given]
    return inputs, made


class RecomputeClock(TorchDispatchMode):
    """Times, over a forward, the ops selective activation checkpointing would recompute: every op that makes a
    new tensor but the kept ones (:func:`is_kept`), each from its call to its return (``sync`` first and after:
    a device's queue), in :attr:`seconds`. Its own overhead aside, what their recomputation takes on this device:
    on a CPU, elementwise ops take a larger share of a layer than their FLOPs or bytes at the memory's peak say."""

    def __init__(self, sync: Callable[[], None]) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.sync = sync
        self.seconds = 0.0
        """Seconds of the ops it would recompute."""

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if is_kept(func):
            return func(*args, **kwargs)
        self.sync()
        began = time.perf_counter()
        out = func(*args, **kwargs)
        self.sync()
        elapsed = time.perf_counter() - began
        if _made(args, kwargs, out)[1]:
            self.seconds += elapsed
        return out


class SelectiveCount(TorchDispatchMode):
    """Counts, over a forward, what selective activation checkpointing would keep and recompute.

    Kept: the outputs of the matmuls and fused attention (:func:`is_kept`), each storage once. Recomputed:
    every other op that makes a new tensor (views and in-place ops aside), with its FLOPs (torch's counter:
    convolutions; elementwise ops count none) and the bytes it reads and writes, which price it at the
    device's memory bandwidth. Enter it around a forward only; on the meta device too.
    """

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.kept = 0
        """Bytes of the kept ops' outputs."""
        self.recompute_flops = 0
        """FLOPs of the recomputed ops."""
        self.recompute_bytes = 0
        """Bytes the recomputed ops read and write."""
        self._storages: set[int] = set()
        self._alive: list[torch.UntypedStorage] = []  # keeps the ids above unique while counting

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs, made = _made(args, kwargs, out)
        if not made:  # a view, or an op in place: no new tensor to keep or recompute
            return out
        if is_kept(func):
            for t in made:
                storage = t.untyped_storage()
                if id(storage) not in self._storages:
                    self._storages.add(id(storage))
                    self._alive.append(storage)
                    self.kept += storage.nbytes()
        else:
            self.recompute_flops += _flops(func, args, kwargs, out)
            self.recompute_bytes += sum(_nbytes(t) for t in inputs) + sum(_nbytes(t) for t in made)
        return out
