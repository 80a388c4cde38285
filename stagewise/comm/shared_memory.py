"""A shared-memory wire between the ranks of one host: point-to-point messages without gloo's threads or sockets."""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import secrets
import selectors
import shutil
import struct
import time
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.distributed as dist

from stagewise.comm import shared_memory_files as files
from stagewise.comm.errors import CommTimeoutError
from stagewise.comm.timeouts import DEFAULT_TIMEOUT
from stagewise.comm.waits import Work
from stagewise.comm.wire import Op

log = logging.getLogger(__name__)

_RECORD = struct.Struct("<qqqq")  # kind, segment, tag, bytes
_MESSAGE, _FREED = 1, 2
_ATOMIC = 4096 // _RECORD.size * _RECORD.size  # a pipe write of at most PIPE_BUF bytes is never split
_SMALLEST = 4096  # segment sizes are powers of two from here
_BROADCAST = -1  # the tag of broadcasts: the transport's messages use tags from 0
_TRIES = 8
"""Fresh names a new segment tries: one taken is improbable (62 random bits), eight in a row something to stop at."""


def _segment_number() -> int:
    """A new segment's number, which its file's name and its messages' records carry: random, so that no one can
    plant a file at the name a segment will take (sequential names in /dev/shm could be guessed)."""
    return secrets.randbits(62)


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

    Each message is copied into a segment of shared memory (a file under
    ``/dev/shm``, mapped by both ranks) and announced by a 32-byte record on
    a named pipe from the sender to the receiver, which copies it out and
    answers with a record that frees the segment for the sender's next
    message of that size. Everything runs in the calling thread, when it
    posts or waits: there are no background threads to compete with the
    compute for the cores, and a rank blocked in a wait sleeps in the kernel
    until a record arrives. The pipes' system calls order the copies on
    every architecture.

    Messages match receives as gloo matches them: per (peer, tag), in the
    order both sides post them. A message that arrives before its receive is
    posted waits in its segment, as gloo leaves it with the sender. A send
    completes once the receiver has copied its data out, so waiting for sends
    means what it means on gloo.
    Segments are kept for reuse, powers of two in size, so a rank holds
    about the most it ever had in flight to each peer. Their files are named
    after their process, which removes them at exit; what a killed process
    left, the next wire's start removes (:mod:`~stagewise.comm.shared_memory_files`).
    Each segment's name ends in a random number, made with ``O_EXCL`` and
    mode 0600: a file planted in ``/dev/shm`` cannot take its place. A write
    to a peer's full pipe waits up to ``timeout`` seconds, then raises
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
        self.timeout = timeout
        """Seconds a write waits for room in a peer's pipe (the transport's timeout)."""
        self.folder = folders[rank]
        self.peers = list(peers)
        self._folders = folders
        self._out: dict[int, int] = {}
        self._in: dict[int, int] = {}
        self._peer_of: dict[int, int] = {}
        self._selector = selectors.DefaultSelector()
        self._gone: set[int] = set()
        self._owed: dict[int, bytes] = {}
        """Records of freed segments a write that timed out left unwritten, by peer: sent first with the next."""
        self._made = 0
        self._segments: dict[int, torch.Tensor] = {}
        """This rank's segments, by number."""
        self._idle: dict[tuple[int, int], list[int]] = {}
        """Segments free for the next message, by (peer, size): a segment serves one peer, which alone maps it."""
        self._sending: dict[tuple[int, int], tuple[int, WireWork]] = {}
        """(peer, segment) of each send in flight: the segment's size, and the work that completes when freed."""
        self._mapped: dict[tuple[int, int], torch.Tensor] = {}
        """Peers' segments mapped here, by (peer, segment)."""
        self._posted: dict[tuple[int, int], deque[tuple[torch.Tensor, WireWork]]] = {}
        self._early: dict[tuple[int, int], deque[tuple[int, torch.Tensor]]] = {}
        """Messages that arrived before their receive was posted, by (peer, tag): each segment's number and data,
        left in the sender's segment (as gloo leaves it with the sender) until the receive is posted."""
        self.closed = False
        files.watch(self)

    @property
    def segments(self) -> int:
        """How many segments this rank has made for its sends (each is reused once its message was received)."""
        return self._made

    def forget_in_child(self) -> None:
        """In a process forked from this rank (a data loader's worker): close the inherited pipes, so that this
        rank's death still reaches its peers as the end of its pipes, and let the wire be."""
        if self.closed:
            return
        for fd in (*self._in.values(), *self._out.values()):
            with contextlib.suppress(OSError):
                os.close(fd)
        self.closed = True

    def connect(self, barrier: Callable[[], None]) -> None:
        """Open the pipes to and from every peer: collective, with ``barrier`` between the steps."""
        for peer in self.peers:
            os.mkfifo(self.folder / f"bell-{peer}", 0o600)
        barrier()
        for peer in self.peers:  # read ends first: a writer's non-blocking open needs a reader
            fd = os.open(self._folders[peer] / f"bell-{self.rank}", os.O_RDONLY | os.O_NONBLOCK)
            self._in[peer], self._peer_of[fd] = fd, peer
            self._selector.register(fd, selectors.EVENT_READ)
        barrier()
        for peer in self.peers:
            self._out[peer] = os.open(self.folder / f"bell-{peer}", os.O_WRONLY | os.O_NONBLOCK)
        barrier()  # every pipe open at both ends before any rank may close its own (a writer's open would fail)
        for peer in self.peers:
            os.unlink(self.folder / f"bell-{peer}")
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
        number = self._segment(peer, data.numel())
        segment = self._segments[number]
        segment[: data.numel()].copy_(data)
        work = WireWork(self, peer)
        self._sending[(peer, number)] = (segment.numel(), work)
        try:
            self._write(peer, _RECORD.pack(_MESSAGE, number, tag, data.numel()))
        except BaseException:  # not announced: the segment is free again
            del self._sending[(peer, number)]
            self._idle.setdefault((peer, segment.numel()), []).append(number)
            raise
        return work

    def irecv(self, tensor: torch.Tensor, peer: int, tag: int) -> WireWork:
        """Post a receive into ``tensor`` (contiguous) of ``peer``'s next message on ``tag``."""
        work = WireWork(self, peer)
        early = self._early.get((peer, tag))
        if early and not self.closed:  # arrived before the peer left, if it did: still mapped here
            number, source = early.popleft()
            self._deliver(source, tensor, peer, tag)
            self._write(peer, _RECORD.pack(_FREED, number, 0, 0), notice=True)
            work.done = True
        else:
            self._check(peer)
            self._posted.setdefault((peer, tag), deque()).append((tensor, work))
        return work

    def _check(self, peer: int) -> None:
        if self.closed:
            raise RuntimeError(f"rank {self.rank}'s shared-memory wire is closed")
        if peer in self._gone:
            raise RuntimeError(_gone(peer))

    def _segment(self, peer: int, nbytes: int) -> int:
        size = max(_SMALLEST, 1 << max(nbytes - 1, 0).bit_length())
        idle = self._idle.get((peer, size))
        if idle:
            return idle.pop()
        number, path, fd = self._create()
        try:
            # Reserve the memory now: a sparse file on a full tmpfs would fail later, on a page, with SIGBUS.
            if hasattr(os, "posix_fallocate"):
                os.posix_fallocate(fd, 0, size)
            else:
                os.ftruncate(fd, size)
        except OSError as err:
            os.unlink(path)
            free = shutil.disk_usage(self.folder.parent).free
            raise RuntimeError(
                f"rank {self.rank} cannot reserve {_size(size)} of shared memory in {self.folder.parent} "
                f"({_size(free)} free: {err.strerror}); give the host more shared memory (docker: "
                "--shm-size), or send through gloo: set STAGEWISE_SHARED_MEMORY=0 (Transport: shared_memory=False)"
            ) from err
        finally:
            os.close(fd)
        self._segments[number] = torch.from_file(str(path), shared=True, size=size, dtype=torch.uint8)
        self._made += 1
        files.made(path)
        return number

    def _create(self) -> tuple[int, Path, int]:
        """A new segment's number, path and open descriptor: a file of this rank alone (``O_EXCL``, mode 0600) at
        a random name; a name taken (planted there, or drawn before) is drawn afresh, up to :data:`_TRIES` times."""
        for _ in range(_TRIES):
            number = _segment_number()
            path = files.segment_path(self.folder, number)
            if number in self._segments:
                continue
            try:
                return number, path, os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            except FileExistsError:
                log.warning("rank %d: %s exists, made by someone else; trying another name", self.rank, path)
        raise RuntimeError(
            f"rank {self.rank} cannot create a shared-memory segment: {_TRIES} random names in a row were taken, "
            f"the last {path}; find what creates files in {self.folder.parent}, or send through gloo: set "
            "STAGEWISE_SHARED_MEMORY=0 (Transport: shared_memory=False)"
        )

    # Progress.

    def progress(self, work: WireWork, deadline: float) -> bool:
        """Handle records until ``work`` completes (True) or ``deadline`` (``time.monotonic``) passes (False)."""
        while not work.done:
            if work.peer in self._gone:
                raise RuntimeError(f"{_gone(work.peer)} before this transfer completed")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            if self._owed:
                self._pay()
            for key, _ in self._selector.select(min(remaining, 0.01) if self._owed else remaining):
                self._drain(int(key.fd))
        return True

    def _drain(self, fd: int) -> None:
        """Handle every record waiting on ``fd``: deliver messages, free acknowledged segments."""
        peer = self._peer_of[fd]
        try:
            chunk = os.read(fd, 64 * _RECORD.size)
        except BlockingIOError:
            return
        if not chunk:
            self._gone.add(peer)
            self._selector.unregister(fd)
            return
        # Whole records only: each write is whole records of at most PIPE_BUF bytes (all or nothing), each read asks
        # for whole records, and a pipe hands out what was written.
        freed = []
        for kind, number, tag, nbytes in _RECORD.iter_unpack(chunk):
            if kind == _FREED:
                size, work = self._sending.pop((peer, number))
                self._idle.setdefault((peer, size), []).append(number)
                work.done = True
                continue
            source = self._map(peer, number)[:nbytes]
            posted = self._posted.get((peer, tag))
            if posted:
                tensor, work = posted.popleft()
                self._deliver(source, tensor, peer, tag)
                work.done = True
            else:
                self._early.setdefault((peer, tag), deque()).append((number, source))
                continue
            freed.append(_RECORD.pack(_FREED, number, 0, 0))
        if freed:
            self._write(peer, b"".join(freed), notice=True)

    def _map(self, peer: int, number: int) -> torch.Tensor:
        """``peer``'s segment ``number``, mapped here on its first message (a segment keeps its size)."""
        segment = self._mapped.get((peer, number))
        if segment is None:
            path = files.segment_path(self._folders[peer], number)
            try:
                with open(path, "r+b") as file:
                    # The sender's memory, mapped: no allocation of this rank's (torch.from_file would count as one).
                    segment = torch.frombuffer(mmap.mmap(file.fileno(), 0), dtype=torch.uint8)
            except OSError as err:
                raise RuntimeError(f"rank {peer}'s shared-memory segment {path} is gone ({err})") from err
            path.unlink(missing_ok=True)  # both ranks have it mapped: nothing is left behind if one dies
            self._mapped[(peer, number)] = segment
        return segment

    def _deliver(self, source: torch.Tensor, tensor: torch.Tensor, peer: int, tag: int) -> None:
        target = _bytes_of(tensor)
        if target.numel() != source.numel():
            raise RuntimeError(
                f"rank {peer} sent {source.numel()} bytes on tag {tag} where rank {self.rank} posted a receive of "
                f"{target.numel()}; both sides must exchange messages in the same order"
            )
        target.copy_(source)

    def _write(self, peer: int, records: bytes, *, notice: bool = False) -> None:
        """Write ``records`` to ``peer``'s pipe, handling incoming records while it is full, for up to the timeout;
        then :class:`CommTimeoutError`. A ``notice`` (freed segments) to a peer that has gone is dropped: it has
        nothing left to reuse; one not written in time is owed, and goes first with the next write to the peer."""
        if notice and peer in self._gone:
            return
        fd = self._out[peer]
        view = memoryview(self._owed.pop(peer, b"") + records)
        deadline = time.monotonic() + self.timeout
        try:
            while view:
                try:
                    view = view[os.write(fd, view[:_ATOMIC]) :]
                except BlockingIOError:  # the peer has not read for a while: serve our side meanwhile
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        raise self._full(peer) from None
                    for key, _ in self._selector.select(min(remaining, 0.001)):
                        self._drain(int(key.fd))
        except BrokenPipeError as err:
            self._gone.add(peer)
            self._owed.pop(peer, None)
            if notice:
                return
            raise RuntimeError(_gone(peer)) from err
        except BaseException:
            # Each write of at most PIPE_BUF bytes is all or nothing, so what is left is whole records: the notices
            # are owed; a message's record (the last, unwritten) is the caller's to take back.
            left = bytes(view) if notice else bytes(view[: len(view) - len(records)])
            if left:
                self._owed[peer] = left + self._owed.get(peer, b"")
            raise

    def _pay(self) -> None:
        """Write the owed notices that the peers' pipes have room for now, without waiting."""
        for peer, owed in list(self._owed.items()):
            view = memoryview(owed)
            try:
                while view:
                    view = view[os.write(self._out[peer], view[:_ATOMIC]) :]
            except BlockingIOError:
                pass
            except BrokenPipeError:
                self._gone.add(peer)
                view = view[len(view) :]
            if view:
                self._owed[peer] = bytes(view)
            else:
                del self._owed[peer]

    def _full(self, peer: int) -> CommTimeoutError:
        what = f"room in rank {peer}'s shared-memory pipe"
        return CommTimeoutError(
            f"rank {self.rank} timed out after {self.timeout:g} s waiting for {what} (full: rank {peer} read "
            "nothing meanwhile); the peer may have hung or been stopped",
            rank=self.rank,
            peer=peer,
            what=what,
        )

    def close(self) -> None:
        """Close the pipes and drop the segments, removing those no peer received. Closing again does nothing."""
        if self.closed:
            return
        self.closed = True
        files.unwatch(self)
        self._selector.close()
        for fd in (*self._in.values(), *self._out.values()):
            os.close(fd)
        for number in self._segments:  # those its peers never received (a peer unlinks what it maps)
            files.unmade(files.segment_path(self.folder, number))
        self._segments.clear()
        self._mapped.clear()
        self._owed.clear()
        shutil.rmtree(self.folder, ignore_errors=True)  # left by a connect that failed


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f} MiB" if nbytes >= 2**20 else f"{nbytes / 2**10:.1f} KiB"


def _gone(peer: int) -> str:
    return f"rank {peer} closed its shared-memory wire (Connection closed: it exited or closed its transport)"


def _bytes_of(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's memory as a flat uint8 tensor (a view)."""
    flat = tensor.detach().reshape(-1)
    return flat.view(torch.uint8) if flat.dtype is not torch.uint8 else flat


def connect_shared_memory(group: dist.ProcessGroup, rank: int, timeout: float | None = None) -> SharedMemoryWire | None:
    """A wire between the ranks of ``group`` (collective), or None where some pair of them shares no memory.

    Each rank makes a folder with a random token in it; the wire is made
    only if every rank can read every other's token, so ranks on other
    hosts, or in containers that do not share ``/dev/shm``, keep gloo.
    ``timeout`` bounds a write to a full pipe, in seconds: by default the
    group's (a transport's group has the transport's timeout).
    """
    if not hasattr(os, "mkfifo"):
        return None
    folder = files.new_folder()
    token = secrets.token_hex(16)
    (folder / "token").write_text(token)
    everyone: list[tuple[int, str, str] | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, (rank, str(folder), token), group=group)
    folders = {r: Path(f) for r, f, _ in everyone}  # type: ignore[misc]
    readable = all(_reads(Path(f) / "token", t) for _, f, t in everyone)  # type: ignore[misc]
    votes: list[bool | None] = [None] * len(everyone)
    dist.all_gather_object(votes, readable, group=group)
    if not all(votes):
        shutil.rmtree(folder, ignore_errors=True)
        log.info("rank %d: not every rank of the transport shares memory with the others; using gloo", rank)
        return None
    seconds = _timeout_of(group) if timeout is None else timeout
    wire = SharedMemoryWire(rank, [r for r in folders if r != rank], folders, timeout=seconds)
    try:
        wire.connect(lambda: dist.barrier(group=group))
    except BaseException:
        wire.close()
        raise
    return wire


def _timeout_of(group: dist.ProcessGroup) -> float:
    """``group``'s timeout in seconds, or the default where this torch does not tell it."""
    try:
        return float(group._get_backend(torch.device("cpu")).options._timeout.total_seconds())
    except (AttributeError, RuntimeError):
        return DEFAULT_TIMEOUT


def _reads(path: Path, token: str) -> bool:
    try:
        return path.read_text() == token
    except OSError:
        return False
