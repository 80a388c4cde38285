"""Saved activations in host memory: autograd's saved-tensor hooks that move them off the device and back."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

MIN_OFFLOAD_BYTES = 1 << 20
"""Saved tensors smaller than this stay on the device: their copies would cost more in launches than they free."""


@dataclass(frozen=True)
class _Offloaded:
    """A saved activation's copy in host memory, and where and when it was made."""

    host: torch.Tensor
    device: torch.device
    copied: torch.cuda.Event
    """Recorded on the offload stream after the copy: the backward's copy back waits for it."""


class ActivationOffload:
    """Moves what a stage's forward saves for its backward to pinned host memory, on a stream of its own, and back
    on the compute stream when the backward unpacks it (see ``Compute.offload_activations``).

    The device copy is freed once the host copy is done (``record_stream`` keeps the caching allocator from
    reusing it before), so the device holds about one micro-batch's activations per stage action. Only CUDA
    tensors of at least :data:`MIN_OFFLOAD_BYTES` move, and never a parameter (or a view of one: a linear saves its
    weight transposed), which stays on the device anyway; on a CPU device nothing moves.
    """

    def __init__(self, device: torch.device, *, min_bytes: int = MIN_OFFLOAD_BYTES) -> None:
        self.device = device
        self.min_bytes = min_bytes
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None  # type: ignore[no-untyped-call]
        self._params: frozenset[int] = frozenset()
        self.moved_bytes = 0
        """Bytes copied to the host so far (each saved activation once), for tests and reports."""

    @contextmanager
    def saving(self, params: Iterable[torch.Tensor]) -> Iterator[None]:
        """Within, autograd's saved activations go to the host (``params``: the stage's parameters, which stay)."""
        if self.stream is None:
            yield
            return
        self._params = frozenset(id(p) for p in params)
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            yield

    def _stays(self, t: torch.Tensor) -> bool:
        base = t._base if t._base is not None else t
        return (
            t.device.type != "cuda"
            or t.layout != torch.strided
            or t.numel() * t.element_size() < self.min_bytes
            or id(t) in self._params
            or id(base) in self._params
        )

    def _pack(self, t: torch.Tensor) -> torch.Tensor | _Offloaded:
        if self._stays(t):
            return t
        assert self.stream is not None  # _pack is installed only with a stream
        host = torch.empty_like(t, device="cpu", pin_memory=True)
        self.stream.wait_stream(torch.cuda.current_stream(t.device))
        with torch.cuda.stream(self.stream):
            host.copy_(t, non_blocking=True)
            copied = torch.cuda.Event()  # type: ignore[no-untyped-call]
            copied.record(self.stream)
        t.record_stream(self.stream)
        self.moved_bytes += t.numel() * t.element_size()
        return _Offloaded(host, t.device, copied)

    @staticmethod
    def _unpack(packed: torch.Tensor | _Offloaded) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        torch.cuda.current_stream(packed.device).wait_event(packed.copied)
        return packed.host.to(packed.device, non_blocking=True)
