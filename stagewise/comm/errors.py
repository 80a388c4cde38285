"""Errors of the communication layer: each names this rank, the peer, and what was awaited."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from stagewise.errors import StagewiseError


class CommError(StagewiseError, RuntimeError):
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


def timed_out(err: BaseException) -> bool:
    """Whether a failed wait of torch.distributed ran out of time (rather than losing its peer)."""
    return "timed out" in str(err).lower() or "timeout" in str(err).lower()


_LOST = ("Connection closed", "Connection reset", "Connection refused", "Broken pipe", "NCCL error")
"""Words of torch.distributed's errors when a peer is lost (timeouts say "timed out")."""


def failed_between_ranks(err: BaseException) -> bool:
    """Whether ``err``, raised by a collective, is about the other ranks (a timeout, a lost peer), not misuse here."""
    return timed_out(err) or any(word in str(err) for word in _LOST)


def first_line(err: BaseException) -> str:
    """An error's first line, or its type's name when it has no text."""
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def collective_failed(err: BaseException, *, rank: int, peer: int, what: str, timeout: float | None) -> CommError:
    """The error to raise for a collective (``what``, with ``peer`` among its ranks) that failed with ``err``;
    ``timeout`` is the group's bound in seconds, when known."""
    if timed_out(err):
        after = f" after {timeout:g} s" if timeout is not None else ""
        return CommTimeoutError(
            f"rank {rank} timed out{after} in {what} ({first_line(err)}); "
            "another rank may have hung or be waiting on something else",
            rank=rank,
            peer=peer,
            what=what,
        )
    return PeerGoneError(f"rank {rank} lost a peer during {what}: {first_line(err)}", rank=rank, peer=peer, what=what)


@contextmanager
def named_collective(*, rank: int, peer: int, what: str, timeout: float | None) -> Iterator[None]:
    """Within, a collective (``what``, with ``peer`` among its ranks) that times out or loses a peer raises the
    named :class:`CommError` of :func:`collective_failed`; any other error passes unchanged."""
    try:
        yield
    except RuntimeError as err:
        if isinstance(err, CommError) or not failed_between_ranks(err):
            raise
        raise collective_failed(err, rank=rank, peer=peer, what=what, timeout=timeout) from err
