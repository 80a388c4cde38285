"""A shared-memory wire between the ranks of one host: point-to-point messages without gloo's threads or sockets."""

from __future__ import annotations

import shutil
import time
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.distributed as dist

from stagewise.comm import shared_memory_files as files
from stagewise.comm.shared_memory_pipes import FREED, MESSAGE, RECORD, Pipes, gone
from stagewise.comm.shared_memory_segments import Mapped, Segments
from stagewise.comm.timeouts import DEFAULT_TIMEOUT
from stagewise.comm.waits import Work
from stagewise.comm.wire import Op

_BROADCAST = -1  # the tag of broadcasts: the transport's messages use tags from 0


class WireWork:
    """One posted send or receive; :meth:`wait` drives the wire until it completes (see ``dist.Work.wait``)."""

    __slots__ = ("done", "peer", "wire")

    def __init__(self, wire: SharedMemoryWire, peer: int) -> None:
        self.wire, self.peer, self.done = wire, peer, False

    def wait(self, timeout: float = DEFAULT_TIMEOUT) -> bool:
        """True once complete; False when ``timeout`` seconds passed first; a lost peer raises RuntimeError."""
        if self.done:
            return True
        return self.wire.progress(self, time.monotonic() + timeout)


class SharedMemoryWire:
    """Point-to-point messages between the ranks of one host through shared memory.

    Each message is copied into a segment of shared memory
    (:mod:`~stagewise.comm.shared_memory_segments`) and announced by a record
    on a named pipe from the sender to the receiver
    (:mod:`~stagewise.comm.shared_memory_pipes`), which copies it out and
    answers with a record that frees the segment for the sender's next
    message of that size. Everything runs in the calling thread, when it
    posts or waits: there are no background threads to compete with the
    compute for the cores.

    Messages match receives as gloo matches them: per (peer, tag), in the
    order both sides post them. A message that arrives before its receive is
    posted waits in its segment, as gloo leaves it with the sender. A send
    completes once the receiver has copied its data out, so waiting for sends
    means what it means on gloo. A write to a peer's full pipe waits up to
    ``timeout`` seconds, then raises
    :class:`~stagewise.comm.errors.CommTimeoutError`.
    """

    matches_tags = True
    """Messages on different tags stay apart, as gloo's do."""
    exclusive = True
    """The pipes and segments are this wire's alone."""

    def __init__(
        self, rank: int, peers: Sequence[int], folders: dict[int, Path], *, timeout: float = DEFAULT_TIMEOUT
    ) -> None:
        self.rank = rank
        self.folder = folders[rank]
        self.peers = list(peers)
        self._folders = folders
        self.pipes = Pipes(rank, timeout)
        self._segments = Segments(rank, self.folder)
        self._mapped = Mapped(folders)
        self._sending: dict[tuple[int, int], tuple[int, WireWork]] = {}
        """(peer, segment) of each send in flight: the segment's size, and the work that completes when freed."""
        self._posted: dict[tuple[int, int], deque[tuple[torch.Tensor, WireWork]]] = {}
        self._early: dict[tuple[int, int], deque[tuple[int, torch.Tensor]]] = {}
        """Messages that arrived before their receive was posted, by (peer, tag): each segment's number and data,
        left in the sender's segment (as gloo leaves it with the sender) until the receive is posted."""
        self.closed = False
        files.watch(self)

    @property
    def timeout(self) -> float:
        """Seconds a write waits for room in a peer's pipe (the transport's timeout)."""
        return self.pipes.timeout

    @timeout.setter
    def timeout(self, seconds: float) -> None:
        self.pipes.timeout = seconds

    @property
    def segments(self) -> int:
        """How many segments this rank has made for its sends (each is reused once its message was received)."""
        return self._segments.made

    def forget_in_child(self) -> None:
        """In a process forked from this rank (a data loader's worker): close the inherited pipes, so that this
        rank's death still reaches its peers as the end of its pipes, and let the wire be."""
        if self.closed:
            return
        self.pipes.forget()
        self.closed = True

    def connect(self, barrier: Callable[[], None]) -> None:
        """Open the pipes to and from every peer: collective, with ``barrier`` between the steps."""
        self.pipes.open(self.folder, self._folders, self.peers, barrier)
        # The folder served the pipes and the token (read by every peer before the first barrier): gone now, so a
        # rank that exits without closing leaves nothing behind but segments no peer received.
        shutil.rmtree(self.folder, ignore_errors=True)

    # Posting.

    def post(self, ops: list[Op]) -> list[Work]:
        """Post ``ops`` in order (see :meth:`isend`, :meth:`irecv`)."""
        return [(self.isend if op.send else self.irecv)(op.tensor, op.peer, op.tag) for op in ops]

    def broadcast(self, tensor: torch.Tensor, source: int, group: dist.ProcessGroup) -> list[tuple[int, Work]]:
        """A message from ``source`` to each other rank of ``group``, on a tag of its own: on ``source`` the
        sends, elsewhere the receive into ``tensor``."""
        if self.rank != source:
            return [(source, self.irecv(tensor, source, _BROADCAST))]
        others = [peer for peer in dist.get_process_group_ranks(group) if peer != source]
        return [(peer, self.isend(tensor, peer, _BROADCAST)) for peer in others]

    def isend(self, tensor: torch.Tensor, peer: int, tag: int) -> WireWork:
        """Copy ``tensor`` (contiguous) into a segment and announce it to ``peer``."""
        self._check(peer)
        data = _bytes_of(tensor)
        number, segment = self._segments.take(peer, data.numel())
        segment[: data.numel()].copy_(data)
        work = WireWork(self, peer)
        self._sending[(peer, number)] = (segment.numel(), work)
        try:
            self._write(peer, RECORD.pack(MESSAGE, number, tag, data.numel()))
        except BaseException:  # not announced: the segment is free again
            del self._sending[(peer, number)]
            self._segments.free(peer, segment.numel(), number)
            raise
        return work

    def irecv(self, tensor: torch.Tensor, peer: int, tag: int) -> WireWork:
        """Post a receive into ``tensor`` (contiguous) of ``peer``'s next message on ``tag``."""
        work = WireWork(self, peer)
        early = self._early.get((peer, tag))
        if early and not self.closed:  # arrived before the peer left, if it did: still mapped here
            number, source = early.popleft()
            self._deliver(source, tensor, peer, tag)
            self._write(peer, RECORD.pack(FREED, number, 0, 0), notice=True)
            work.done = True
        else:
            self._check(peer)
            self._posted.setdefault((peer, tag), deque()).append((tensor, work))
        return work

    def _check(self, peer: int) -> None:
        if self.closed:
            raise RuntimeError(f"rank {self.rank}'s shared-memory wire is closed")
        if peer in self.pipes.gone:
            raise RuntimeError(gone(peer))

    # Progress.

    def progress(self, work: WireWork, deadline: float) -> bool:
        """Handle records until ``work`` completes (True) or ``deadline`` (``time.monotonic``) passes (False)."""
        while not work.done:
            if work.peer in self.pipes.gone:
                raise RuntimeError(f"{gone(work.peer)} before this transfer completed")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            if self.pipes.owes:
                self.pipes.pay()
            for fd in self.pipes.ready(min(remaining, 0.01) if self.pipes.owes else remaining):
                self._drain(fd)
        return True

    def _drain(self, fd: int) -> None:
        """Handle every record waiting on ``fd``: deliver messages, free acknowledged segments."""
        peer, chunk = self.pipes.read(fd)
        freed = []
        for kind, number, tag, nbytes in RECORD.iter_unpack(chunk):
            if kind == FREED:
                size, work = self._sending.pop((peer, number))
                self._segments.free(peer, size, number)
                work.done = True
                continue
            source = self._mapped.segment(peer, number)[:nbytes]
            posted = self._posted.get((peer, tag))
            if posted:
                tensor, work = posted.popleft()
                self._deliver(source, tensor, peer, tag)
                work.done = True
            else:
                self._early.setdefault((peer, tag), deque()).append((number, source))
                continue
            freed.append(RECORD.pack(FREED, number, 0, 0))
        if freed:
            self._write(peer, b"".join(freed), notice=True)

    def _deliver(self, source: torch.Tensor, tensor: torch.Tensor, peer: int, tag: int) -> None:
        target = _bytes_of(tensor)
        if target.numel() != source.numel():
            raise RuntimeError(
                f"rank {peer} sent {source.numel()} bytes on tag {tag} where rank {self.rank} posted a receive of "
                f"{target.numel()}; both sides must exchange messages in the same order"
            )
        target.copy_(source)

    def _write(self, peer: int, records: bytes, *, notice: bool = False) -> None:
        """Write ``records`` to ``peer``'s pipe, handling incoming records while it is full (see
        :meth:`Pipes.write <stagewise.comm.shared_memory_pipes.Pipes.write>`)."""
        self.pipes.write(peer, records, serve=self._drain, notice=notice)

    def close(self) -> None:
        """Close the pipes and drop the segments, removing those no peer received. Closing again does nothing."""
        if self.closed:
            return
        self.closed = True
        files.unwatch(self)
        self.pipes.close()
        self._segments.remove()
        self._mapped.clear()
        shutil.rmtree(self.folder, ignore_errors=True)  # left by a connect that failed


def _bytes_of(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's memory as a flat uint8 tensor (a view)."""
    flat = tensor.detach().reshape(-1)
    return flat.view(torch.uint8) if flat.dtype is not torch.uint8 else flat
