"""How many backwards each rank pools its weight gradients over, and how many micro-batches that makes it hold."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

from stagewise.schedule.actions import Action, Kind, Schedule, forwards_first
from stagewise.schedule.validate import peak_in_flight

Pool = int | Literal["free"] | None
"""How many consecutive backwards of a rank pool their weight gradients: a count, "free" (what fits in the
pipeline's peak in flight, see :func:`free_pool`), or None (the schedule's own: a whole step where every forward
comes first, else none)."""


class Pooling(Protocol):
    """What the holdings need of a weight-gradient fusion setting (``stagewise.pipeline.WeightGradientFusion``)."""

    @property
    def pool(self) -> Pool: ...


@dataclass(frozen=True)
class PoolPolicy:
    """A pooling setting on its own, for planning without the runtime's fusion settings."""

    pool: Pool = "free"
    """See :data:`Pool`."""


FREE = PoolPolicy()
"""``Pipeline``'s default: each rank pools what fits in the pipeline's peak in flight."""


@dataclass(frozen=True)
class Holding:
    """One moment of a stage: micro-batches in flight, and backwards whose weight gradients wait in a pool."""

    in_flight: int
    """Micro-batches forwarded whose backward has not run: their saved activations are held."""
    pooled: int = 0
    """Backwards run whose pooled weight gradients are not computed yet: their linears' inputs and output
    gradients are held."""


def _changes(actions: Sequence[Action]) -> list[int]:
    """Per action, how it changes the micro-batches held in flight: +1 for F, -1 for B or I, 0 for W."""
    return [1 if action.kind is Kind.F else -1 if action.kind.is_backward else 0 for action in actions]


def _peak_held(changes: Sequence[int], pool: int) -> int:
    """The most micro-batches a rank holds at once, in flight or pooled, when every ``pool`` backwards flush."""
    in_flight = pooled = peak = backwards = 0
    for change in changes:
        if change > 0:
            in_flight += 1
            peak = max(peak, in_flight + pooled)
        elif change < 0:
            in_flight, pooled, backwards = in_flight - 1, pooled + 1, backwards + 1
            if backwards % pool == 0:
                pooled = 0
    return peak


def free_pool(schedule: Schedule, rank: int) -> int | None:
    """How many consecutive backwards of ``rank`` can pool their weight gradients without raising the pipeline's peak.

    A pooled backward keeps the inputs and output gradients of its linear
    layers until the pool is flushed: about what its forward kept for it, so
    it counts as a micro-batch still in flight. The pool is the largest
    that keeps this rank's micro-batches in flight and pooled within the most
    that any rank holds in flight, (stage, micro-batch) pairs counted alike.
    None: all of the step's (GPipe, whose forwards all come first); 1: none.
    For 1F1B over p ranks, rank r may pool r + 1.
    """
    return _free_pool(schedule.ranks[rank], _fullest(schedule))


def _fullest(schedule: Schedule) -> int:
    """The most micro-batches any rank of ``schedule`` holds in flight: what a free pool must stay within."""
    return max(_peak_held(_changes(actions), 1) for actions in schedule.ranks)


def _free_pool(mine: Sequence[Action], limit: int) -> int | None:
    """:func:`free_pool` of a rank running ``mine``, within ``limit`` micro-batches."""
    changes = _changes(mine)
    backwards = changes.count(-1)
    fits = [k for k in range(1, backwards + 1) if _peak_held(changes, k) <= limit]
    best = max(fits, default=1)
    return None if best == backwards > 1 else best


def rank_pool(
    fusion: Pooling | None,
    schedule: Schedule,
    rank: int,
    actions: Sequence[Action] | None = None,
    *,
    checkpointing: bool = False,
) -> int | None:
    """How many backwards of ``rank`` pool their weight gradients under ``fusion`` (None: the whole step); 1: none.

    ``actions`` are what the rank runs (its share of ``schedule`` by default).
    Nothing pools with a split backward, where each micro-batch's W computes
    its own, nor under ``pool="free"`` with activation checkpointing, where a
    pooled backward would keep more than its forward did.
    """
    actions = schedule.ranks[rank] if actions is None else actions
    return _choose(fusion, actions, lambda: free_pool(schedule, rank), checkpointing)


def _choose(
    fusion: Pooling | None, actions: Sequence[Action], free: Callable[[], int | None], checkpointing: bool
) -> int | None:
    """:func:`rank_pool`, with ``free`` working out the rank's free pool only when it is needed."""
    if fusion is None or any(action.kind is Kind.W for action in actions):
        return 1
    if fusion.pool == "free":
        return 1 if checkpointing else free()
    if fusion.pool is not None:
        return fusion.pool
    return None if forwards_first(actions) else 1


def _moments(actions: Sequence[Action], pool: int | None, stage: int) -> tuple[Holding, ...]:
    """The moments of ``stage`` that no other moment of it exceeds in both micro-batches in flight and pooled."""
    in_flight = pooled = backwards = 0
    seen = set()
    for action in actions:
        mine = action.stage == stage
        if action.kind is Kind.F and mine:
            in_flight += 1
        elif action.kind.is_backward:
            backwards += 1
            if mine:
                in_flight, pooled = in_flight - 1, pooled + 1
        else:
            continue
        seen.add((in_flight, pooled))  # a full pool is held while its flush computes
        if action.kind.is_backward and pool is not None and backwards % pool == 0:
            pooled = 0
    return _undominated(seen)


def _undominated(seen: set[tuple[int, int]]) -> tuple[Holding, ...]:
    """The (in flight, pooled) counts that no other count exceeds in both, fewest in flight first."""
    top: list[tuple[int, int]] = []
    for a, b in sorted(seen, reverse=True):  # most in flight first: keep those with more pooled than any before
        if not top or b > top[-1][1]:
            top.append((a, b))
    return tuple(Holding(a, b) for a, b in reversed(top))


def _split_moments(actions: Sequence[Action], stage: int) -> tuple[Holding, ...]:
    """A rank that splits its backwards: per moment, ``stage``'s micro-batches from F to W (the input pass keeps
    their graph for W) and from I to W (it keeps the gradients of the outputs W starts from), undominated."""
    in_flight = waiting = 0
    seen = set()
    for action in actions:
        if action.stage != stage:
            continue
        if action.kind is Kind.F:
            in_flight += 1
        elif action.kind is Kind.I:
            waiting += 1
        elif action.kind is Kind.W:
            seen.add((in_flight, waiting))  # held while W computes
            in_flight, waiting = in_flight - 1, waiting - 1
        else:  # B: a backward that is not split
            in_flight -= 1
        seen.add((in_flight, waiting))
    return _undominated(seen)


def holdings(
    schedule: Schedule, fusion: Pooling | None = FREE, *, checkpointing: bool = False
) -> tuple[tuple[Holding, ...], ...]:
    """Per stage: the moments that can be its fullest, in micro-batches in flight and pooled (``MemoryModel.holdings``).

    ``fusion`` is what ``Pipeline`` was given as ``fuse_weight_gradients``,
    with the same default; None, autograd's accumulation (as
    ``WeightGradientFusion.off()``, whose pool is 1), pools nothing.
    Where a rank pools nothing each of its stages has one moment, its peak in
    flight. A rank that splits its backwards (zero-bubble) holds a
    micro-batch from F to W and its output gradients from I to W: there
    ``pooled`` counts the micro-batches waiting for W, which keep
    :attr:`~stagewise.partition.LayerCost.use_bytes` (with the pooled linears'
    :attr:`~stagewise.partition.LayerCost.pooled_bytes`) each.
    """
    peaks = peak_in_flight(schedule)
    free = fusion is not None and fusion.pool == "free" and not checkpointing
    limit = _fullest(schedule) if free else 0  # once, where it is used
    out: list[tuple[Holding, ...]] = [()] * schedule.n_stages
    for rank, actions in enumerate(schedule.ranks):
        pool = _choose(fusion, actions, functools.partial(_free_pool, actions, limit), checkpointing)
        split = any(action.kind is Kind.W for action in actions)
        for stage in schedule.stages_of(rank):
            if split:
                out[stage] = _split_moments(actions, stage)
            else:
                out[stage] = (Holding(peaks[stage]),) if pool == 1 else _moments(actions, pool, stage)
    return tuple(out)
