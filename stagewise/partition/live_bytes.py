"""LiveBytes: the bytes of the tensors created under it that are still alive, and their peak, on any device."""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class LiveBytes(TorchDispatchMode):
    """Counts the storages that operations create while it is active, until each is freed; keeps the peak.

    It sees every operation, the backward's too, so on the meta device it
    tells what a forward and backward would hold at their fullest without
    allocating anything: ``torch.cuda.max_memory_allocated`` for tensors that
    have no memory. A storage counts once however many views share it;
    tensors that existed before it was entered (parameters, inputs) do not
    count, nor do their views. Memory an operation uses internally and frees
    before it returns is not seen.

        with LiveBytes() as live:
            loss_fn(logits, target).backward()
        live.peak  # bytes
    """

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.current = 0
        """Bytes of the counted storages alive now."""
        self.peak = 0
        """The most bytes alive at once since the mode was made."""
        self._sizes: dict[int, int] = {}

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        # A view or an in-place operation returns an input's storage: counted where it was made, or not at all.
        given = {id(t.untyped_storage()) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and id(t.untyped_storage()) not in given:
                self._count(t.untyped_storage())
        self.peak = max(self.peak, self.current)
        return out

    def _count(self, storage: torch.UntypedStorage) -> None:
        # The Python storage object lives exactly as long as the storage (torch preserves it), so its identity
        # names the storage while it lives, and its finaliser runs when the storage is freed.
        key = id(storage)
        if key in self._sizes:
            return
        size = storage.nbytes()
        self._sizes[key] = size
        self.current += size
        weakref.finalize(storage, self._freed, key)

    def _freed(self, key: int) -> None:
        self.current -= self._sizes.pop(key, 0)
