"""The shared-memory wire's pipes: a named pipe each way between two ranks, carrying 32-byte records whole.

A sender announces each message by a record (:data:`RECORD`) on its pipe to
the receiver, which answers with a record that frees the segment. The pipes'
system calls order the copies on every architecture, and a rank blocked in a
wait sleeps in the kernel until a record arrives. A write to a peer's full
pipe waits up to ``timeout`` seconds, handling incoming records meanwhile,
then raises :class:`~stagewise.comm.errors.CommTimeoutError`.
"""

from __future__ import annotations

import contextlib
import os
import selectors
import struct
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from stagewise.comm.errors import CommTimeoutError

RECORD = struct.Struct("<qqqq")  # kind, segment, tag, bytes
MESSAGE, FREED = 1, 2
"""The kinds of record: a message in a segment, and a segment the receiver has copied out (free again)."""
_ATOMIC = 4096 // RECORD.size * RECORD.size  # a pipe write of at most PIPE_BUF bytes is never split


def gone(peer: int) -> str:
    """What a rank whose pipe has ended is, in words."""
    return f"rank {peer} closed its shared-memory wire (Connection closed: it exited or closed its transport)"


class Pipes:
    """This rank's pipes to and from each peer: records written whole, read whole; a peer whose pipe ends is gone."""

    def __init__(self, rank: int, timeout: float) -> None:
        self.rank = rank
        self.timeout = timeout
        """Seconds a write waits for room in a peer's pipe."""
        self.out: dict[int, int] = {}
        """The write end of the pipe to each peer."""
        self._in: dict[int, int] = {}
        self._peer_of: dict[int, int] = {}
        self._selector = selectors.DefaultSelector()
        self.gone: set[int] = set()
        """Peers whose pipe has ended (they exited or closed their wire)."""
        self._owed: dict[int, bytes] = {}
        """Records of freed segments a write that timed out left unwritten, by peer: sent first with the next."""

    def open(self, folder: Path, folders: dict[int, Path], peers: Sequence[int], barrier: Callable[[], None]) -> None:
        """Open the pipes to and from every peer, made in ``folder`` (this rank's; ``folders``: every rank's):
        collective, with ``barrier`` between the steps."""
        for peer in peers:
            os.mkfifo(folder / f"bell-{peer}", 0o600)
        barrier()
        for peer in peers:  # read ends first: a writer's non-blocking open needs a reader
            fd = os.open(folders[peer] / f"bell-{self.rank}", os.O_RDONLY | os.O_NONBLOCK)
            self._in[peer], self._peer_of[fd] = fd, peer
            self._selector.register(fd, selectors.EVENT_READ)
        barrier()
        for peer in peers:
            self.out[peer] = os.open(folder / f"bell-{peer}", os.O_WRONLY | os.O_NONBLOCK)
        barrier()  # every pipe open at both ends before any rank may close its own (a writer's open would fail)
        for peer in peers:
            os.unlink(folder / f"bell-{peer}")

    def ready(self, timeout: float) -> list[int]:
        """The incoming pipes with records to read, waiting up to ``timeout`` seconds for one."""
        return [int(key.fd) for key, _ in self._selector.select(timeout)]

    def read(self, fd: int) -> tuple[int, bytes]:
        """The peer of incoming pipe ``fd`` and the whole records waiting there (none: nothing yet, or the peer
        has gone)."""
        peer = self._peer_of[fd]
        try:
            chunk = os.read(fd, 64 * RECORD.size)
        except BlockingIOError:
            return peer, b""
        if not chunk:
            self.gone.add(peer)
            self._selector.unregister(fd)
        # Whole records only: each write is whole records of at most PIPE_BUF bytes (all or nothing), each read asks
        # for whole records, and a pipe hands out what was written.
        return peer, chunk

    def write(self, peer: int, records: bytes, *, serve: Callable[[int], None], notice: bool = False) -> None:
        """Write ``records`` to ``peer``'s pipe, handing incoming pipes to ``serve`` while it is full, for up to the
        timeout; then :class:`CommTimeoutError`. A ``notice`` (freed segments) to a peer that has gone is dropped:
        it has nothing left to reuse; one not written in time is owed, and goes first with the next write to the
        peer."""
        if notice and peer in self.gone:
            return
        fd = self.out[peer]
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
                    for ready in self.ready(min(remaining, 0.001)):
                        serve(ready)
        except BrokenPipeError as err:
            self.gone.add(peer)
            self._owed.pop(peer, None)
            if notice:
                return
            raise RuntimeError(gone(peer)) from err
        except BaseException:
            # Each write of at most PIPE_BUF bytes is all or nothing, so what is left is whole records: the notices
            # are owed; a message's record (the last, unwritten) is the caller's to take back.
            left = bytes(view) if notice else bytes(view[: len(view) - len(records)])
            if left:
                self._owed[peer] = left + self._owed.get(peer, b"")
            raise

    @property
    def owes(self) -> bool:
        """Whether notices wait to be written (see :meth:`pay`)."""
        return bool(self._owed)

    def pay(self) -> None:
        """Write the owed notices that the peers' pipes have room for now, without waiting."""
        for peer, owed in list(self._owed.items()):
            view = memoryview(owed)
            try:
                while view:
                    view = view[os.write(self.out[peer], view[:_ATOMIC]) :]
            except BlockingIOError:
                pass
            except BrokenPipeError:
                self.gone.add(peer)
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

    def forget(self) -> None:
        """Close the descriptors (inherited by a forked child), so that this rank's death still reaches its peers
        as the end of its pipes."""
        for fd in (*self._in.values(), *self.out.values()):
            with contextlib.suppress(OSError):
                os.close(fd)

    def close(self) -> None:
        """Close the pipes, dropping owed notices."""
        self._selector.close()
        for fd in (*self._in.values(), *self.out.values()):
            os.close(fd)
        self._owed.clear()
