"""The tensors a transport holds between calls: its sends in flight, and received buffers kept for reuse."""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Sequence

import torch

from stagewise.comm.meta import TensorMeta
from stagewise.comm.waits import Pending, Work

_POOL_DEPTH = 4  # buffers kept per (dtype, shape); more are left to the allocator
_POOL_SHAPES = 8  # (dtype, shape) pairs kept, the most recently released; older ones are dropped
_PRUNE_AT = 16  # sends in flight before the waited ones are first dropped from the list


class SendsInFlight:
    """Sends posted and not yet waited for, each keeping its tensors, and the memory those tensors occupy."""

    def __init__(self) -> None:
        self._pending: list[Pending] = []
        self._prune_at = _PRUNE_AT
        self._reading: Counter[int] = Counter()
        """Storages that sends in flight read, with how many sends read each (see :meth:`reads`)."""

    def __len__(self) -> int:
        """Sends kept: those in flight, and waited ones not yet let go of."""
        return len(self._pending)

    def start(
        self, works: list[Work], *, rank: int, peer: int, what: str, timeout: float, keep: list[torch.Tensor]
    ) -> Pending:
        """Sends posted: kept in flight, with their tensors, until waited for."""
        pending = Pending(works, rank, peer, what, timeout, keep, done=self._sent_off)
        for t in keep:
            self._reading[t.untyped_storage().data_ptr()] += 1
        if len(self._pending) >= self._prune_at:
            # Let go of the sends already waited for, now and then (amortised: the list is rebuilt only when
            # it doubles). Gloo cannot tell whether a send has completed without waiting for it, so the
            # others stay until wait_all().
            self._pending = [p for p in self._pending if p.works]
            self._prune_at = max(_PRUNE_AT, 2 * len(self._pending))
        self._pending.append(pending)
        return pending

    def _sent_off(self, tensors: Sequence[torch.Tensor]) -> None:
        """A send has completed: its tensors' memory may be reused (see :meth:`reads`)."""
        for t in tensors:
            key = t.untyped_storage().data_ptr()
            self._reading[key] -= 1
            if self._reading[key] <= 0:
                del self._reading[key]

    def reads(self, tensor: torch.Tensor) -> bool:
        """Whether a send in flight reads ``tensor``'s memory (gloo reads a send's data only when the receiver
        asks for it), so that it must not be reused yet."""
        return tensor.untyped_storage().data_ptr() in self._reading

    def wait_all(self) -> None:
        """Wait for every send posted so far (bounded by the timeout each)."""
        pending, self._pending = self._pending, []
        for sends in pending:
            sends.wait()

    def drop(self) -> None:
        """Let go of every send without waiting (after an error)."""
        self._pending = []


class BufferPool:
    """Received tensors handed back for reuse by later receives of the same dtype and shape: a few each, for the
    most recently released shapes (sequence lengths vary)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._stacks: OrderedDict[tuple[torch.dtype, tuple[int, ...]], list[torch.Tensor]] = OrderedDict()

    def __len__(self) -> int:
        """Buffers kept."""
        return sum(len(stack) for stack in self._stacks.values())

    def take(self, meta: TensorMeta) -> torch.Tensor:
        """A buffer for a tensor of ``meta``: one kept, or a new one."""
        stack = self._stacks.get((meta.dtype, meta.shape))
        if stack:
            return stack.pop()
        return meta.empty(self.device)

    def keep(self, tensor: torch.Tensor) -> None:
        """Keep ``tensor`` (on the pool's device, out of any autograd graph, read by no send) for reuse."""
        key = (tensor.dtype, tuple(tensor.shape))
        stack = self._stacks.setdefault(key, [])
        self._stacks.move_to_end(key)
        if len(self._stacks) > _POOL_SHAPES:  # varying shapes (sequence lengths): keep the recent ones
            self._stacks.popitem(last=False)
        if len(stack) < _POOL_DEPTH:
            tensor.requires_grad_(False)
            tensor.grad = None
            stack.append(tensor)
