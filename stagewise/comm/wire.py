"""The wire interface: what carries a transport's point-to-point messages and broadcasts between ranks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist

from stagewise.comm.waits import Work


@dataclass(frozen=True)
class Op:
    """One send or receive of a tensor (contiguous, not empty) to or from ``peer``, matched by ``tag``."""

    send: bool
    tensor: torch.Tensor
    peer: int
    tag: int


class Wire(Protocol):
    """Carries tensors between the ranks of a transport.

    Messages match receives per (peer, tag) in the order both sides post
    them (a wire that cannot tell tags apart keeps each tag's ordering by
    other means). A send completes once its data has left the tensor, a
    receive once its data has arrived. Every wait takes seconds.
    """

    matches_tags: bool
    """Whether messages on different tags between two ranks stay apart whatever the order of posting (gloo and
    shared memory; not NCCL): the transport then may post a data receive before its control word arrives."""

    @property
    def exclusive(self) -> bool:
        """Whether the wire carries this transport's messages alone (process groups or pipes of its own), so
        receives still posted can be dropped with it."""
        ...

    def post(self, ops: list[Op]) -> list[Work]:
        """Post ``ops`` in order, without waiting; one work per op."""
        ...

    def broadcast(self, tensor: torch.Tensor, source: int, group: dist.ProcessGroup) -> list[tuple[int, Work]]:
        """Post the broadcast of ``source``'s ``tensor`` into the others' (same shape) over ``group``'s ranks.

        Returns (peer, work) pairs: on ``source`` its sends (each peer, or one
        rank of the group for a collective), elsewhere the receive from ``source``.
        """
        ...

    def close(self) -> None:
        """Let go of what the wire holds (pipes, segments, process groups of its own); closing again does nothing."""
        ...
