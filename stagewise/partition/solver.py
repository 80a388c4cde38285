"""solve(): the exact minimum-bottleneck contiguous split, by feasibility probes over reachable stage boundaries."""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from stagewise.partition.range_cost import FloatArray, RangeCost

# A closed interval [lo, hi] of layer positions; kept as a plain pair inside this
# hot loop. Nothing outside this module sees it.
_Interval = tuple[int, int]


@dataclass(frozen=True)
class SplitProblem:
    """Split ``n_layers`` into ``n_stages`` non-empty contiguous stages minimising the worst objective."""

    n_stages: int
    objective: RangeCost
    """What is minimised: the maximum over stages of this cost."""
    constraint: RangeCost | None = None
    """Optional per-stage cost that must stay at or below ``limits``."""
    limits: FloatArray | None = None
    """Per-stage upper bound of ``constraint``."""

    @property
    def n_layers(self) -> int:
        return self.objective.n_layers


@dataclass(frozen=True)
class Solution:
    """An optimal split: stage ``s`` holds layers ``bounds[s]:bounds[s + 1]``."""

    bounds: tuple[int, ...]
    bottleneck: float


class _Prober:
    """Answers "is there a split whose every stage costs at most T?" and produces one."""

    def __init__(self, problem: SplitProblem) -> None:
        self.p = problem
        n, k = problem.n_layers, problem.n_stages
        self.n, self.k = n, k
        obj = problem.objective
        # Worst single layer per stage: when it fits, the stage has no blockers
        # and the probe needs no per-layer scan.
        if obj.plain:
            # Division is monotone, so max(x) / d is exactly the largest x_i / d.
            widest = float(np.max(np.diff(obj.x_prefix))) if n else 0.0
            self.max_single = [float(np.float64(widest) / d) for d in obj.divisor]
        else:
            self.max_single = [float(np.max(obj.singles(j))) for j in range(k)]
        self.con_blockers: list[npt.NDArray[np.intp] | None] = [None] * k
        if problem.constraint is not None:
            assert problem.limits is not None
            for j in range(k):
                over = problem.constraint.singles(j) > problem.limits[j]
                self.con_blockers[j] = np.flatnonzero(over) if over.any() else None

    def _fits(self, stage: int, start: int, bound: float) -> int:
        stop = self.p.objective.reach(stage, start, bound)
        con = self.p.constraint
        if con is not None:
            assert self.p.limits is not None
            stop = min(stop, con.reach(stage, start, float(self.p.limits[stage])))
        return stop

    def _blockers(self, stage: int, lo: int, hi: int, bound: float) -> npt.NDArray[np.intp] | None:
        """Layers in ``lo..hi`` that cannot sit alone on ``stage``; None when there are none."""
        found: list[npt.NDArray[np.intp]] = []
        if self.max_single[stage] > bound:
            over = np.flatnonzero(self.p.objective.singles(stage, lo, hi + 1) > bound)
            if over.size:
                found.append(over + lo)
        con = self.con_blockers[stage]
        if con is not None:
            inside = con[np.searchsorted(con, lo) : np.searchsorted(con, hi, side="right")]
            if inside.size:
                found.append(inside)
        if not found:
            return None
        return found[0] if len(found) == 1 else np.unique(np.concatenate(found))

    def reachable(self, bound: float) -> list[list[_Interval]] | None:
        """Positions where stage ``j`` can end, for each ``j``; None when layer ``n`` is unreachable.

        ``sets[j]`` holds the positions reachable after ``j`` stages, as sorted
        disjoint closed intervals. A stage starting at ``a`` can end anywhere in
        ``a+1 .. fits(a)``; heavy layers that fit no stage on their own cut holes
        in these sets, which is why they are interval lists and not one interval.
        """
        n, k = self.n, self.k
        sets: list[list[_Interval]] = [[(0, 0)]]
        for j in range(k):
            last_end = n - (k - 1 - j)  # leave one layer for each later stage
            ends: list[_Interval] = []
            for lo, hi in sets[-1]:
                if lo + 1 > last_end:
                    break
                far = self._fits(j, hi, bound)
                blocked = self._blockers(j, lo, hi, bound)
                start = lo + 1
                if blocked is not None:
                    for layer in blocked.tolist():
                        if layer + 1 > start:
                            ends.append((start, min(layer, last_end)))
                        start = layer + 2  # no stage here can end just after a blocked layer
                if far > hi:  # layer hi fits alone, so every end up to far is open
                    ends.append((start, min(far, last_end)))
            merged = _merged(ends)
            if not merged:
                return None
            sets.append(merged)
        return sets if sets[-1][-1][1] == n else None

    def witness(self, sets: list[list[_Interval]], bound: float) -> tuple[int, ...]:
        """One split within ``bound``; backwards from the last stage, each stage starts as early as it can."""
        bounds = [self.n]
        stop = self.n
        for j in range(self.k - 1, -1, -1):
            first = self.p.objective.first_start(j, stop, bound)
            con = self.p.constraint
            if con is not None:
                assert self.p.limits is not None
                first = max(first, con.first_start(j, stop, float(self.p.limits[j])))
            start = -1
            for lo, hi in sets[j]:
                if hi >= first and lo <= stop - 1:
                    start = max(lo, first)
                    break
            assert 0 <= start < stop, "reachable sets and witness disagree"
            bounds.append(start)
            stop = start
        return tuple(reversed(bounds))

    def bottleneck(self, bounds: tuple[int, ...]) -> float:
        obj = self.p.objective
        return max(obj.of(j, bounds[j], bounds[j + 1]) for j in range(self.k))


def _merged(intervals: list[_Interval]) -> list[_Interval]:
    """``intervals`` (sorted by start) with the empty ones dropped and those that touch or overlap joined."""
    merged: list[_Interval] = []
    for lo, hi in intervals:
        if lo > hi:
            continue
        if merged and lo <= merged[-1][1] + 1:
            if hi > merged[-1][1]:
                merged[-1] = (merged[-1][0], hi)
        else:
            merged.append((lo, hi))
    return merged


def _bits(value: float) -> int:
    return int(struct.unpack("<q", struct.pack("<d", value))[0])


def _from_bits(bits: int) -> float:
    return float(struct.unpack("<d", struct.pack("<q", bits))[0])


def lower_bound(problem: SplitProblem) -> float:
    """A value no split can beat: 0, or for a plain weighted objective the usual averaging bounds."""
    obj = problem.objective
    if not obj.plain or problem.n_layers == 0:
        return 0.0
    total = float(obj.x_prefix[-1])
    heaviest = float(np.max(np.diff(obj.x_prefix)))
    return max(total / float(np.sum(obj.divisor)), heaviest / float(np.max(obj.divisor)))


def solve(problem: SplitProblem) -> Solution | None:
    """The split with the smallest bottleneck, or None when the constraint admits no split.

    Feasibility at bound T is monotone in T, and the optimum is one of the
    float values the objective takes. The search bisects over the ordered bit
    patterns of non-negative floats, so it ends on the exact smallest feasible
    value after at most 64 probes. The split returned is the witness of the
    final probe, so its bottleneck is that smallest feasible value.
    """
    prober = _Prober(problem)
    sets = prober.reachable(math.inf)
    if sets is None:
        return None
    hi = prober.bottleneck(prober.witness(sets, math.inf))
    hi_bits = _bits(hi)
    lo_bits = -1  # "below zero": always infeasible
    guess = lower_bound(problem) * (1.0 - 1e-9)
    if 0.0 < guess < hi and prober.reachable(guess) is None:
        lo_bits = _bits(guess)
    while hi_bits - lo_bits > 1:
        mid_bits = (lo_bits + hi_bits) // 2
        if prober.reachable(_from_bits(mid_bits)) is None:
            lo_bits = mid_bits
        else:
            hi_bits = mid_bits
    hi = _from_bits(hi_bits)
    final = prober.reachable(hi)
    assert final is not None
    bounds = prober.witness(final, hi)
    return Solution(bounds=bounds, bottleneck=prober.bottleneck(bounds))
