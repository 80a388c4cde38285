"""The built-in schedules, each defined once: GPipe, 1F1B, interleaved 1F1B, looped BFS, zero-bubble (ZB-H1) and
the V-shaped ZBV and DualPipeV."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Literal, get_args

from stagewise.errors import is_whole
from stagewise.schedule.actions import Action, Kind, Schedule

ScheduleName = Literal["gpipe", "1f1b", "interleaved-1f1b", "looped-bfs", "zero-bubble", "zbv", "dualpipev"]
"""The schedules :func:`build` knows, each with its :class:`Builder` in :data:`BUILDERS`."""


def gpipe(n_ranks: int, n_microbatches: int) -> list[list[Action]]:
    """Fill-drain (GPipe): every forward, then every backward; each stage holds all ``m`` micro-batches."""
    m = n_microbatches
    return [[Action(r, Kind.F, i) for i in range(m)] + [Action(r, Kind.B, i) for i in range(m)] for r in range(n_ranks)]


def one_f_one_b(n_ranks: int, n_microbatches: int) -> list[list[Action]]:
    """PipeDream-flush (1F1B): ``p - r - 1`` warm-up forwards, then alternate F and B, then drain.

    Rank ``r`` holds at most ``min(p - r, m)`` micro-batches; the bubble is GPipe's.
    """
    p, m = n_ranks, n_microbatches
    ranks = []
    for r in range(p):
        warm = min(p - r - 1, m)
        order = [Action(r, Kind.F, i) for i in range(warm)]
        for i in range(m - warm):
            order += [Action(r, Kind.F, warm + i), Action(r, Kind.B, i)]
        order += [Action(r, Kind.B, i) for i in range(m - warm, m)]
        ranks.append(order)
    return ranks


def interleaved_one_f_one_b(n_ranks: int, n_virtual: int, n_microbatches: int) -> list[list[Action]]:
    """Megatron-LM's interleaved 1F1B: rank ``r`` holds stages ``r, r + p, ...``, ``v`` of them.

    Micro-batches go through a rank's stages in groups of ``p``, so ``m`` must
    be a multiple of ``p``. Warm-up is ``2 (p - r - 1) + (v - 1) p`` forwards
    (all of them when ``m == p``), then 1F1B over the ``m v`` stage-micro-batches.
    The bubble shrinks by about ``v`` against 1F1B; each rank holds more
    micro-batches in flight.
    """
    p, v, m = n_ranks, n_virtual, n_microbatches
    total = m * v

    def forward(k: int) -> Action:
        chunk = (k // p) % v
        return Action(chunk * p + r, Kind.F, (k // (p * v)) * p + k % p)

    def backward(k: int) -> Action:
        chunk = v - 1 - (k // p) % v
        return Action(chunk * p + r, Kind.B, (k // (p * v)) * p + k % p)

    ranks = []
    for r in range(p):
        warm = total if m == p else min(2 * (p - r - 1) + (v - 1) * p, total)
        order = [forward(k) for k in range(warm)]
        for k in range(total - warm):
            order += [forward(warm + k), backward(k)]
        order += [backward(k) for k in range(total - warm, total)]
        ranks.append(order)
    return ranks


def looped_bfs(n_ranks: int, n_virtual: int, n_microbatches: int) -> list[list[Action]]:
    """Looped breadth-first (Lamy-Poirier, 2023; torch's ScheduleLoopedBFS): rank ``r`` holds stages ``r, r + p,
    ...``, runs every micro-batch's forward through each of them in turn, then every backward in reverse.

    Each rank holds all ``m`` micro-batches of each of its stages (GPipe's memory, ``v`` stages' worth), in
    exchange for the fewest switches between stages; any ``m``.
    """
    p, v, m = n_ranks, n_virtual, n_microbatches
    ranks = []
    for r in range(p):
        mine = [r + k * p for k in range(v)]
        order = [Action(s, Kind.F, i) for s in mine for i in range(m)]
        order += [Action(s, Kind.B, i) for s in reversed(mine) for i in range(m)]
        ranks.append(order)
    return ranks


def v_shape(n_ranks: int) -> tuple[int, ...]:
    """The V placement of ``2 p`` stages: rank ``r`` holds stages ``r`` and ``2p - 1 - r``, so the first and the
    last stage share rank 0, and each micro-batch turns back at rank ``p - 1`` without a transfer."""
    return tuple(range(n_ranks)) + tuple(reversed(range(n_ranks)))


def zbv(n_ranks: int, n_microbatches: int) -> list[list[Action]]:
    """ZB-V (Qi et al., 2023, section 6, as torch's ``ScheduleZBVZeroBubble``): zero-bubble's split backward on
    the V placement (:func:`v_shape`).

    Rank ``r`` holds stages ``a = r`` and ``b = 2p - 1 - r`` and runs, for ``n = max(m, 2p - 1)`` micro-batches
    (those past ``m`` then dropped): ``2(p - r) - 1`` forwards of ``a``; ``r`` pairs F(b), F(a); ``p - r``
    rounds F(b), I(b), W(b); the steady state of rounds F(a), I(a), W(a), F(b), I(b), W(b) (F(a) while any is
    left) until both stages have run every forward; ``r`` pairs I(a), I(b) with their W deferred; ``p - r``
    rounds I(a) and the oldest deferred W(a); the deferred W of ``b``, then of ``a``. With F = I = W its bubble
    at ``p = 4, m = 8`` is 1/17 (1F1B's 3/11), and its order keeps it when transfers take time.
    """
    p, m = n_ranks, n_microbatches
    n = max(m, 2 * p - 1)
    ranks = []
    for r in range(p):
        a, b = r, 2 * p - 1 - r
        order = _RankOrder()
        for _ in range(2 * (p - r) - 1):
            order.forward(a)
        for _ in range(r):
            order.forward(b)
            order.forward(a)
        for _ in range(p - r):
            order.forward(b)
            order.backward(b, split=True)
            order.weights(b)
        while order.count(b, Kind.F) < order.count(a, Kind.F) or order.count(a, Kind.F) < n:
            if order.count(a, Kind.F) < n:
                order.forward(a)
            order.backward(a, split=True)
            order.weights(a)
            order.forward(b)
            order.backward(b, split=True)
            order.weights(b)
        for _ in range(r):
            order.backward(a, split=True)
            order.backward(b, split=True)
        for _ in range(p - r):
            order.backward(a, split=True)
            order.weights(a)
        for stage in (b, a):
            while order.pending(stage):
                order.weights(stage)
        ranks.append([action for action in order.actions if action.microbatch < m])
    return ranks


class _RankOrder:
    """One rank's actions as they are appended, each stage's micro-batches counted in order, W deferred in a queue."""

    def __init__(self) -> None:
        self.actions: list[Action] = []
        self._next: dict[tuple[int, Kind], int] = {}
        self._deferred: list[Action] = []

    def _take(self, stage: int, kind: Kind) -> int:
        key = (stage, Kind.F if kind is Kind.F else Kind.B)  # B and I count the same backwards
        mb = self._next.get(key, 0)
        self._next[key] = mb + 1
        return mb

    def count(self, stage: int, kind: Kind) -> int:
        """The stage's forwards (F) or backwards (B or I) appended so far."""
        return self._next.get((stage, kind), 0)

    def forward(self, stage: int) -> None:
        self.actions.append(Action(stage, Kind.F, self._take(stage, Kind.F)))

    def backward(self, stage: int, *, split: bool = False) -> None:
        """The stage's next backward: whole (B), or its input part (I) with its W queued for :meth:`weights`."""
        mb = self._take(stage, Kind.B)
        self.actions.append(Action(stage, Kind.I if split else Kind.B, mb))
        if split:
            self._deferred.append(Action(stage, Kind.W, mb))

    def pending(self, stage: int) -> bool:
        """Whether a W of ``stage`` is queued."""
        return any(w.stage == stage for w in self._deferred)

    def weights(self, stage: int | None = None) -> None:
        """The oldest queued W (of ``stage``, if given), if any."""
        found = next((k for k, w in enumerate(self._deferred) if stage is None or w.stage == stage), None)
        if found is not None:
            self.actions.append(self._deferred.pop(found))


def dualpipev(n_ranks: int, n_microbatches: int) -> list[list[Action]]:
    """DualPipeV (DeepSeek's DualPipe cut in half, as torch's ``ScheduleDualPipeV``) on the V placement.

    Rank ``r`` holds stages ``a = r`` and ``b = 2p - 1 - r`` (:func:`v_shape`) and runs, in order:
    ``2(p - r - 1)`` forwards of ``a``; ``r + 1`` pairs F(a), F(b); ``p - r - 1`` rounds I(b), W(b), F(b); then
    the steady state, ``m - 2p + r + 1`` rounds F(a), B(b), F(b), B(a) (DualPipe overlaps each F with the B after
    it: on hardware that runs them at once, its bubble shrinks further; here they run one after the other); the
    drain, ``p - r - 1`` rounds B(b), F(b), B(a); ``r + 1`` pairs of backwards of ``b`` and ``a``, which split
    into I and W from the middle pair on, their W deferred; the ``p - r - 1`` last backwards of ``a``, split,
    each after a deferred W; the W left. Needs ``m >= 2p``; each rank holds at most ``2p + 1`` stage-micro-batches.
    """
    p, m = n_ranks, n_microbatches
    ranks = []
    for r in range(p):
        a, b = r, 2 * p - 1 - r
        order = _RankOrder()
        for _ in range(2 * (p - r - 1)):
            order.forward(a)
        for _ in range(r + 1):
            order.forward(a)
            order.forward(b)
        for _ in range(p - r - 1):
            order.backward(b, split=True)
            order.weights()
            order.forward(b)
        for _ in range(m - 2 * p + r + 1):
            order.forward(a)
            order.backward(b)
            order.forward(b)
            order.backward(a)
        for _ in range(p - r - 1):
            order.backward(b)
            order.forward(b)
            order.backward(a)
        middle = (r + 1) // 2  # from this pair on, backwards split (on an odd rank from b's, on an even from a's)
        for i in range(r + 1):
            order.backward(b, split=i > middle or (i == middle and r % 2 == 1))
            order.backward(a, split=i >= middle)
        for _ in range(p - r - 1):
            order.weights()
            order.backward(a, split=True)
        for _ in range(r + 1):
            order.weights()
        ranks.append(order.actions)
    return ranks


def zero_bubble(n_ranks: int, n_microbatches: int) -> list[list[Action]]:
    """ZB-H1 (Qi et al., 2023): backward split into I (input gradient) and W (weight gradient).

    I is on the critical path and W is not, so W waits and fills the slots
    where 1F1B idles. The order comes from list-scheduling unit-time actions:
    at each step a free rank runs the first that can start of I, then F, then
    W. F may start while fewer than ``min(p - r, m)`` micro-batches are
    between F and I (1F1B's in-flight bound, so peak activation memory equals
    1F1B's) and fewer than ``p - 1`` more await W (the weight-gradient state
    kept). With F = I = W the bubble is a third of 1F1B's.
    """
    p, m = n_ranks, n_microbatches
    f_end: dict[tuple[int, int], int] = {}
    i_end: dict[tuple[int, int], int] = {}
    next_f = [0] * p
    waiting: list[deque[int]] = [deque() for _ in range(p)]  # forwarded, awaiting I
    pending: list[deque[int]] = [deque() for _ in range(p)]  # I done, awaiting W
    ranks: list[list[Action]] = [[] for _ in range(p)]
    t = 0
    while any(len(order) < 3 * m for order in ranks):
        for r in range(p):
            limit = min(p - r, m)
            choice: Action | None = None
            if waiting[r]:
                mb = waiting[r][0]
                grad_at = f_end[(r, mb)] if r == p - 1 else i_end.get((r + 1, mb), t + 1)
                if grad_at <= t:
                    choice = Action(r, Kind.I, mb)
            if choice is None and next_f[r] < m and len(waiting[r]) < limit:
                input_at = 0 if r == 0 else f_end.get((r - 1, next_f[r]), t + 1)
                if input_at <= t and len(waiting[r]) + len(pending[r]) < limit + p - 1:
                    choice = Action(r, Kind.F, next_f[r])
            if choice is None and pending[r]:
                choice = Action(r, Kind.W, pending[r][0])
            if choice is None:
                continue
            ranks[r].append(choice)
            if choice.kind is Kind.F:
                f_end[(r, choice.microbatch)] = t + 1
                waiting[r].append(choice.microbatch)
                next_f[r] += 1
            elif choice.kind is Kind.I:
                i_end[(r, choice.microbatch)] = t + 1
                pending[r].append(waiting[r].popleft())
            else:
                pending[r].popleft()
        t += 1
    return ranks


@dataclass(frozen=True)
class Builder:
    """One built-in schedule: how it orders each rank's actions, and the shapes it takes.

    What a schedule holds and whether it splits its backward are not stated
    here: they are read off a built :class:`Schedule`
    (``stagewise.schedule.peak_in_flight``, ``holdings``,
    :attr:`Schedule.splits_backward`).
    """

    order: Callable[[int, int, int], list[list[Action]]]
    """(ranks, stages per rank, micro-batches) -> each rank's actions, in order."""
    virtual: bool = False
    """True: it runs ``n_virtual >= 2`` stages per rank (exactly :attr:`stages_per_rank` where that is set);
    False: one stage per rank."""
    whole_rounds: bool = False
    """True: the micro-batches must be a multiple of the rank count (interleaved 1F1B's groups of ``p``)."""
    stages_per_rank: int | None = None
    """The only number of stages per rank it takes (the V's 2); None: any its :attr:`virtual` allows."""
    placement: Callable[[int], tuple[int, ...]] | None = None
    """(ranks) -> the rank of each stage; None: round robin (stage ``s`` on rank ``s % p``)."""
    least_rounds: int = 0
    """The micro-batches must be at least this many times the rank count (DualPipeV's ``2p``, one per stage)."""


BUILDERS: Mapping[ScheduleName, Builder] = MappingProxyType(
    {
        "gpipe": Builder(lambda p, v, m: gpipe(p, m)),
        "1f1b": Builder(lambda p, v, m: one_f_one_b(p, m)),
        "interleaved-1f1b": Builder(interleaved_one_f_one_b, virtual=True, whole_rounds=True),
        "looped-bfs": Builder(looped_bfs, virtual=True),
        "zero-bubble": Builder(lambda p, v, m: zero_bubble(p, m)),
        "zbv": Builder(lambda p, v, m: zbv(p, m), virtual=True, stages_per_rank=2, placement=v_shape),
        "dualpipev": Builder(
            lambda p, v, m: dualpipev(p, m), virtual=True, stages_per_rank=2, placement=v_shape, least_rounds=2
        ),
    }
)
"""Every :data:`ScheduleName` with its builder: the one place a built-in schedule is defined."""


def build(name: ScheduleName, n_stages: int, n_microbatches: int, *, n_virtual: int = 1) -> Schedule:
    """The schedule ``name`` for ``n_stages`` stages and ``n_microbatches`` micro-batches.

    ``n_virtual`` is the number of stages per rank, so the pipeline has
    ``n_stages // n_virtual`` ranks; only a :attr:`Builder.virtual` schedule
    ("interleaved-1f1b", "looped-bfs", "zbv", "dualpipev") takes more than 1, and needs more
    ("zbv", "dualpipev": exactly 2, placed in a V).

    Raises:
        ValueError: an unknown name, or counts the schedule cannot take; the
            message gives the values and what would fit.
    """
    if name not in BUILDERS:
        raise ValueError(f"unknown schedule {name!r}; choose one of {list(get_args(ScheduleName))}")
    for field, value in (("n_stages", n_stages), ("n_microbatches", n_microbatches), ("n_virtual", n_virtual)):
        if not is_whole(value):
            raise TypeError(f"{field} must be an int, got {type(value).__name__}")
        if value < 1:
            raise ValueError(f"{field} must be >= 1, got {value}")
    builder = BUILDERS[name]
    _check_shape(name, builder, n_stages, n_microbatches, n_virtual)
    n_ranks = n_stages // n_virtual
    ranks = builder.order(n_ranks, n_virtual, n_microbatches)
    placement = builder.placement(n_ranks) if builder.placement is not None else ()
    return Schedule(name, n_stages, n_microbatches, tuple(tuple(r) for r in ranks), placement)


def _check_shape(name: str, builder: Builder, n_stages: int, n_microbatches: int, n_virtual: int) -> None:
    """Refuse, with what would fit, the counts that ``builder`` cannot take."""
    if builder.stages_per_rank is not None and n_virtual != builder.stages_per_rank:
        raise ValueError(
            f"{name} holds exactly {builder.stages_per_rank} stages per rank, got n_virtual={n_virtual}; give it "
            f"n_stages = {builder.stages_per_rank} x the ranks and n_virtual={builder.stages_per_rank}"
        )
    if builder.virtual:
        if n_virtual < 2:
            raise ValueError(f"{name} needs n_virtual >= 2 stages per rank, got {n_virtual}; use '1f1b' for one")
    elif n_virtual != 1:
        raise ValueError(f"{name} runs one stage per rank; got n_virtual={n_virtual}. Use 'interleaved-1f1b'")
    if n_stages % n_virtual:
        raise ValueError(
            f"n_stages={n_stages} is not a multiple of n_virtual={n_virtual}; "
            f"each of the n_stages / n_virtual ranks holds n_virtual stages"
        )
    n_ranks = n_stages // n_virtual
    if n_microbatches < builder.least_rounds * n_ranks:
        raise ValueError(
            f"{name} needs at least {builder.least_rounds} x the ranks = {builder.least_rounds * n_ranks} "
            f"micro-batches ({n_ranks} ranks), got {n_microbatches}; give it {builder.least_rounds * n_ranks} or more"
        )
    if builder.whole_rounds and n_microbatches % n_ranks:
        fits = n_ranks * max(1, round(n_microbatches / n_ranks))
        raise ValueError(
            f"{name} needs n_microbatches to be a multiple of the number of ranks "
            f"({n_ranks} = {n_stages} stages / {n_virtual} per rank), got {n_microbatches}; try {fits}"
        )
