"""Bounded waits on posted transfers: a timeout or a lost peer becomes an error that names what was awaited."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from stagewise.comm.errors import CommTimeoutError, PeerGoneError, first_line, timed_out


class Work(Protocol):
    """A posted transfer of a wire: ``wait`` is True once it completed, False when ``timeout`` seconds passed first;
    a lost peer raises RuntimeError."""

    def wait(self, timeout: float) -> bool: ...


@dataclass
class Pending:
    """Sends in flight; :meth:`wait` bounds the wait by the transport's timeout."""

    works: list[Work]
    rank: int
    peer: int
    what: str
    timeout: float
    """Seconds each wait may last."""
    keep: list[torch.Tensor] = field(default_factory=list)
    """The tensors being sent, kept alive until the sends complete."""
    done: Callable[[Sequence[torch.Tensor]], None] | None = None
    """Told of ``keep`` once the sends have completed (the transport then lets their memory be reused)."""

    def wait(self) -> None:
        for work in self.works:
            wait_for(work, rank=self.rank, peer=self.peer, what=self.what, timeout=self.timeout, sending=True)
        if self.done is not None and self.keep:
            self.done(self.keep)
        self.works, self.keep = [], []


def wait_for(work: Work, *, rank: int, peer: int, what: str, timeout: float, sending: bool) -> None:
    """Wait for ``work`` up to ``timeout`` seconds; a timeout or a lost peer is an error naming both ranks and
    ``what``."""
    verb, direction = ("sending", "to") if sending else ("waiting for", "from")
    try:
        finished = work.wait(timeout)
    except RuntimeError as err:
        text = first_line(err)
        if timed_out(err):
            raise CommTimeoutError(
                f"rank {rank} timed out after {timeout:g} s {verb} {what} {direction} rank {peer} "
                f"({text}); the peer may have hung or be waiting on something else",
                rank=rank,
                peer=peer,
                what=what,
            ) from err
        raise PeerGoneError(
            f"rank {rank} lost rank {peer} while {verb} {what}: {text}", rank=rank, peer=peer, what=what
        ) from err
    if finished is False:
        raise CommTimeoutError(
            f"rank {rank} timed out after {timeout:g} s {verb} {what} {direction} rank {peer}",
            rank=rank,
            peer=peer,
            what=what,
        )
