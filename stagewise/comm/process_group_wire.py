"""The process-group wire: point-to-point messages and broadcasts through torch.distributed (gloo, or NCCL)."""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from stagewise.comm.waits import Work
from stagewise.comm.wire import Op


class TorchWork:
    """A torch.distributed work whose :meth:`wait` takes seconds, as every wait of stagewise does."""

    __slots__ = ("work",)

    def __init__(self, work: dist.Work) -> None:
        self.work = work

    def wait(self, timeout: float) -> bool:
        """True once complete; False when ``timeout`` seconds passed first (torch may raise instead)."""
        return self.work.wait(timedelta(seconds=timeout)) is not False


class ProcessGroupWire:
    """Messages over ``group`` (None: the default group) with torch.distributed's non-blocking send and receive.

    Gloo keeps tags apart. NCCL ignores them and matches the messages
    between two ranks in the order both post them, so where the backend is
    not gloo (or with ``separate=True``) each of the ``streams`` gets a process
    group of its own, created collectively (every rank of the default group
    must construct the wire, in the same order): a message's tag ``t`` then
    goes to stream ``t // 2``'s group with tag ``t % 2``. Where the backend
    batches (NCCL), the ops of one post are one coalesced batch. A broadcast
    is torch's, over the group it is given.
    """

    def __init__(self, group: dist.ProcessGroup | None, *, streams: int, separate: bool | None, timeout: float) -> None:
        backend = dist.get_backend(group)
        self.group = group
        self.matches_tags = backend == "gloo"
        self._coalesces = not self.matches_tags
        ranks = None if group is None else dist.get_process_group_ranks(group)
        apart = streams > 1 and (not self.matches_tags if separate is None else separate)
        wait = timedelta(seconds=timeout)
        self._stream_groups: list[dist.ProcessGroup | None] = (
            [dist.new_group(ranks, timeout=wait, backend=backend) for _ in range(streams)] if apart else []
        )
        """With separate streams, each stream's own group: tags then tell only a control word from data."""

    @property
    def exclusive(self) -> bool:
        """Whether the wire made process groups of its own (one per stream), which no one else's messages use."""
        return bool(self._stream_groups)

    def post(self, ops: list[Op]) -> list[Work]:
        """Post ``ops`` in order: one coalesced batch where the backend batches (NCCL), else one by one."""
        if not ops:
            return []
        if self._coalesces:
            batch = [
                dist.P2POp(dist.isend if op.send else dist.irecv, op.tensor, op.peer, *self._route(op)) for op in ops
            ]
            return [TorchWork(w) for w in dist.batch_isend_irecv(batch)]
        works: list[Work] = []
        for op in ops:  # what batch_isend_irecv does for gloo
            group, tag = self._route(op)
            post = dist.isend if op.send else dist.irecv
            work = post(op.tensor, op.peer, group, tag)
            assert work is not None  # non-blocking: always a work
            works.append(TorchWork(work))
        return works

    def _route(self, op: Op) -> tuple[dist.ProcessGroup | None, int]:
        if self._stream_groups:
            return self._stream_groups[op.tag // 2], op.tag % 2
        return self.group, op.tag

    def broadcast(self, tensor: torch.Tensor, source: int, group: dist.ProcessGroup) -> list[tuple[int, Work]]:
        """Torch's broadcast over ``group``: on ``source`` named after one other rank of it, elsewhere after
        ``source``."""
        work = dist.broadcast(tensor, src=source, group=group, async_op=True)
        assert work is not None  # async_op: always a work
        peer = source
        if dist.get_rank() == source:
            peer = next(r for r in dist.get_process_group_ranks(group) if r != source)
        return [(peer, TorchWork(work))]

    def close(self) -> None:
        """Destroy the stream groups the wire made; closing again does nothing."""
        groups, self._stream_groups = self._stream_groups, []
        for group in groups:
            dist.destroy_process_group(group)
