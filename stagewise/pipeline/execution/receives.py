"""Receives posted ahead of the actions that need them, so that transfers overlap the compute before them."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from stagewise.comm import Transport
from stagewise.comm.payload import Payload, PayloadLayout
from stagewise.comm.receiving import Receiving
from stagewise.schedule.actions import Action, Kind, Schedule
from stagewise.schedule.spans import Span

ACTIVATIONS, GRADIENTS = 0, 1
"""Transport streams: activations flow forward on one, gradients backward on the other."""

LOOKAHEAD = 2
"""Receives are posted for this many actions ahead of the one running."""


def source(schedule: Schedule, position: int, action: Action) -> tuple[int, int] | None:
    """(position, stream) that ``action`` on the rank at ``position`` receives from; None when its input is local."""
    s = action.stage
    if action.kind is Kind.F and s > 0:
        src, stream = schedule.rank_of(s - 1), ACTIVATIONS
    elif action.kind.is_backward and s < schedule.n_stages - 1:
        src, stream = schedule.rank_of(s + 1), GRADIENTS
    else:
        return None
    return None if src == position else (src, stream)


class PostedReceives:
    """One rank's receives for a pass over its actions, posted in action order, one outstanding per (peer, stream).

    A backward's receive is posted only once its forward has run: the
    gradient's layout is the forward output's, so only data travels. Each
    wait is recorded as a :class:`Span`.
    """

    def __init__(
        self,
        schedule: Schedule,
        position: int,
        actions: Sequence[Action],
        transport: Transport,
        peers: Sequence[int],
        *,
        gradient_layout_of: Callable[[Action], PayloadLayout | None],
        start: float,
    ) -> None:
        self.schedule, self.position, self.actions = schedule, position, actions
        self.transport, self.peers = transport, peers
        self.gradient_layout_of = gradient_layout_of
        """The layout of the gradient a backward action receives; None while its forward has not run here."""
        self.start = start
        """``time.perf_counter()`` at the start of the pass: spans count from it."""
        self.posted: dict[int, Receiving] = {}
        self.busy: set[tuple[int, int]] = set()
        self.cursor = 0
        """The next action whose receive is not posted yet."""
        self.spans: list[Span] = []
        """Time spent waiting for transfers."""

    def post(self, upto: int) -> None:
        """Post receives for actions up to ``upto``, in order, one outstanding per (peer, stream)."""
        while self.cursor < min(upto, len(self.actions)):
            action = self.actions[self.cursor]
            src = source(self.schedule, self.position, action)
            if src is not None:
                expect = None
                if action.kind.is_backward:
                    expect = self.gradient_layout_of(action)
                    if expect is None:  # its forward has not run yet, so its gradient's layout is unknown
                        return
                if src in self.busy:
                    return
                self.busy.add(src)
                thing = "activation" if action.kind is Kind.F else "gradient"
                self.posted[self.cursor] = self.transport.irecv(
                    self.peers[src[0]],
                    what=f"the {thing} of micro-batch {action.microbatch} for {action} (stage {action.stage})",
                    stream=src[1],
                    expect=expect,
                )
            self.cursor += 1

    def take(self, i: int) -> Payload | None:
        """The payload action ``i`` receives, once it has arrived; None when its input is local."""
        src = source(self.schedule, self.position, self.actions[i])
        if src is None:
            return None
        self.post(i + 1)
        handle = self.posted.pop(i)
        waited = time.perf_counter() - self.start
        payload = handle.wait()
        self.busy.discard(src)
        ended = time.perf_counter() - self.start
        self.spans.append(Span(self.position, f"wait {self.actions[i]}", "wait", waited, ended))
        return payload
