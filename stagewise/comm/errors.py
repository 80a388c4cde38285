"""Errors of the communication layer: each names this rank, the peer, and what was awaited."""

from __future__ import annotations


class CommError(RuntimeError):
    """A point-to-point wait that failed: it timed out, or the peer is gone."""

    def __init__(self, message: str, *, rank: int, peer: int, what: str) -> None:
        super().__init__(message)
        self.rank = rank
        """This process's global rank."""
        self.peer = peer
        """The global rank it was exchanging with."""
        self.what = what
        """What it was waiting for, as the caller described it."""

    def __reduce__(self) -> tuple[object, ...]:
        return (_rebuild, (type(self), str(self), self.rank, self.peer, self.what))


def _rebuild(cls: type[CommError], message: str, rank: int, peer: int, what: str) -> CommError:
    return cls(message, rank=rank, peer=peer, what=what)


class CommTimeoutError(CommError):
    """A wait passed its timeout; the peer may be hung, deadlocked, or slower than the timeout allows."""


class PeerGoneError(CommError):
    """The peer closed the connection, usually because its process died."""
