"""Exact minimum-bottleneck contiguous split, by feasibility probes over reachable stage boundaries."""

from __future__ import annotations

import functools
import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from stagewise.partition.shared_cost import Tie

FloatArray = npt.NDArray[np.float64]

# A closed interval [lo, hi] of layer positions; kept as a plain pair inside this
# hot loop. Nothing outside this module sees it.
_Interval = tuple[int, int]


def _weighted(form: tuple[float, ...], sums: Sequence[Any]) -> Any:
    """``sum of form[t] * sums[t]``, in order: on scalars and arrays alike, so both round the same way."""
    value = form[0] * sums[0]
    for c, v in zip(form[1:], sums[1:], strict=True):
        value = value + c * v
    return value


def _starts(y_prefix: FloatArray, head: FloatArray) -> FloatArray:
    """``G = Y - head`` per start, non-decreasing: where rounding made it fall, lowered to what comes after."""
    begin = y_prefix[:-1] - np.asarray(head, dtype=np.float64)
    out: FloatArray = np.minimum.accumulate(begin[::-1])[::-1]
    return out


@dataclass(frozen=True)
class RangeCost:
    """Cost of layers ``start:stop`` on stage ``j``: ``(sum x + held) / divisor[j]``.

    ``held`` is the largest, over the stage's forms ``f``, of
    ``sum over t of forms[j][f][t] * sum y_t``: per-layer quantities ``y_t``
    (activation bytes per micro-batch, say) counted as many times as each
    moment of the stage holds them, the worst moment counting. A ``y_t`` with
    a head adds ``head_t[start]`` to its sum over a non-empty range: what the
    range's first layer holds on top of its ``y_t`` because no layer before it
    shares it (bytes two neighbouring layers save, counted in the second's
    head). Sums come from prefix arrays, so every cost is computed by one
    fixed formula; the solver's comparisons and the reported loads therefore
    agree to the bit. A head must keep costs monotone: ``0 <= head[i] <= y[i - 1] + head[i - 1]``.
    A range's sum is then ``Y[stop] - G[start]``, where ``Y`` is the prefix
    sum of ``y_t`` and ``G = Y - head`` per start, lowered where rounding
    left it falling (by an ulp or so, which can only raise a cost), so that
    costs are monotone in floating point as well: a range never costs less
    than one inside it.

    With :attr:`ties`, ``x`` of a range counts each tie's amount once when the
    range holds any of its layers: the prefix sums are of ``x`` less every
    tie's amount, and each tie present adds its amount back. Both parts grow
    with the range, so costs stay monotone in floating point too.
    """

    x_prefix: FloatArray
    """Prefix sums of the per-layer ``x`` (length ``n_layers + 1``)."""
    y_prefix: tuple[FloatArray, ...]
    """Prefix sums of each per-layer ``y_t``; empty for a plain weighted sum."""
    forms: tuple[tuple[tuple[float, ...], ...], ...]
    """Per stage, its forms: one multiplier per ``y_t`` each; empty with ``y_prefix``."""
    divisor: FloatArray
    """Per-stage divisor (a stage's speed, or 1)."""
    scale: FloatArray | None = None
    """Each stage's one multiplier, when every stage has one form of one term (the common case); None otherwise."""
    starts: tuple[FloatArray | None, ...] = ()
    """Per ``y_t`` with a head: ``G``, what a range's sum subtracts from ``Y[stop]`` per start (non-decreasing,
    one per layer); None without a head; empty: no heads."""
    ties: tuple[Tie, ...] = ()
    """Amounts of ``x`` that several layers include and a range counts once; ``x_prefix`` leaves them out."""

    @staticmethod
    def of_layers(
        x: FloatArray,
        n_stages: int,
        *,
        y: Sequence[FloatArray] = (),
        forms: Sequence[Sequence[Sequence[float]]] = (),
        divisor: FloatArray | None = None,
        heads: Sequence[FloatArray | None] = (),
        ties: Sequence[Tie] = (),
    ) -> RangeCost:
        """Build from per-layer ``x`` and ``y_t``, each stage's forms (one multiplier per ``y_t`` each), heads and
        ties (checked by the caller: see :class:`Tie`)."""

        def prefix(values: FloatArray) -> FloatArray:
            return np.concatenate(([0.0], np.cumsum(values, dtype=np.float64)))

        shaped = tuple(tuple(tuple(float(c) for c in form) for form in stage) for stage in forms)
        if y and (len(shaped) != n_stages or any(not stage for stage in shaped)):
            raise ValueError(f"give one or more forms for each of the {n_stages} stages, got {len(shaped)} stages")
        if any(len(form) != len(y) for stage in shaped for form in stage):
            raise ValueError(f"every form needs one multiplier per per-layer term ({len(y)})")
        if heads and len(heads) != len(y):
            raise ValueError(f"give one head (or None) per per-layer term ({len(y)}), got {len(heads)}")
        simple = len(y) == 1 and all(len(stage) == 1 for stage in shaped)
        if ties:
            x = np.array(x, dtype=np.float64)
            for tie in ties:
                x[list(tie.layers)] -= tie.amount
            x = np.maximum(x, 0.0)  # rounding may leave a layer that is all ties an ulp below 0
        return RangeCost(
            x_prefix=prefix(x),
            y_prefix=tuple(prefix(v) for v in y),
            forms=shaped if y else (),
            divisor=np.ones(n_stages, dtype=np.float64) if divisor is None else np.asarray(divisor, dtype=np.float64),
            scale=np.array([stage[0][0] for stage in shaped], dtype=np.float64) if simple else None,
            starts=tuple(None if h is None else _starts(prefix(v), h) for v, h in zip(y, heads, strict=True))
            if any(h is not None for h in heads)
            else (),
            ties=tuple(ties),
        )

    @property
    def n_layers(self) -> int:
        return len(self.x_prefix) - 1

    @property
    def plain(self) -> bool:
        """Whether the cost is a weighted sum of ``x`` alone, which prefix-sum searches can invert."""
        return not self.y_prefix and not self.ties

    def _sum(self, t: int, start: int, stop: int) -> Any:
        """``y_t`` summed over layers ``start:stop``, with the head of ``start`` when the range is not empty."""
        y = self.y_prefix[t]
        begin = self.starts[t] if self.starts else None
        if begin is None or stop <= start:
            return y[stop] - y[start]
        return y[stop] - begin[start]

    def of(self, stage: int, start: int, stop: int) -> float:
        """Cost of layers ``start:stop`` on ``stage``."""
        total = self.x_prefix[stop] - self.x_prefix[start]
        for tie in self.ties:
            if tie.holds(start, stop):
                total = total + tie.amount
        if self.y_prefix:
            if self.scale is not None:  # the common case, in the solver's inner loop
                total = total + self.scale[stage] * self._sum(0, start, stop)
            elif len(self.y_prefix) == 2:  # activations and pooled bytes: the same sums as _weighted, inlined
                dy, dz = self._sum(0, start, stop), self._sum(1, start, stop)
                total = total + max(a * dy + b * dz for a, b in self.forms[stage])
            else:
                sums = [self._sum(t, start, stop) for t in range(len(self.y_prefix))]
                total = total + max(_weighted(form, sums) for form in self.forms[stage])
        return float(total / self.divisor[stage])

    def singles(self, stage: int, start: int = 0, stop: int | None = None) -> FloatArray:
        """Cost of each layer of ``start:stop`` alone on ``stage``, by the same formula as :meth:`of`."""
        stop = self.n_layers if stop is None else stop
        total = self.x_prefix[start + 1 : stop + 1] - self.x_prefix[start:stop]
        for tie in self.ties:  # adding 0 is exact, so each layer gets the same sum as in :meth:`of`
            held = np.zeros(stop - start)
            inside = [i - start for i in tie.layers if start <= i < stop]
            held[inside] = tie.amount
            total = total + held
        if self.y_prefix:
            sums = [y[start + 1 : stop + 1] - y[start:stop] for y in self.y_prefix]
            for t, begin in enumerate(self.starts):
                if begin is not None:
                    sums[t] = self.y_prefix[t][start + 1 : stop + 1] - begin[start:stop]
            total = total + functools.reduce(np.maximum, (_weighted(form, sums) for form in self.forms[stage]))
        out: FloatArray = total / self.divisor[stage]
        return out

    def reach(self, stage: int, start: int, limit: float) -> int:
        """The largest ``stop`` in ``[start, n]`` with ``of(stage, start, stop) <= limit``."""
        n = self.n_layers
        if self.plain:
            if math.isinf(limit):
                return n
            target = self.x_prefix[start] + limit * self.divisor[stage]
            stop = int(np.searchsorted(self.x_prefix, target, side="right")) - 1
            stop = min(max(stop, start), n)
            # The estimate can be off by rounding; step to the exact answer.
            while stop > start and self.of(stage, start, stop) > limit:
                stop -= 1
            while stop < n and self.of(stage, start, stop + 1) <= limit:
                stop += 1
            return stop
        lo, hi = start, n  # of(start, lo) == 0 <= limit always holds
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.of(stage, start, mid) <= limit:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def first_start(self, stage: int, stop: int, limit: float) -> int:
        """The smallest ``start`` in ``[0, stop]`` with ``of(stage, start, stop) <= limit``."""
        if self.plain:
            if math.isinf(limit):
                return 0
            target = self.x_prefix[stop] - limit * self.divisor[stage]
            start = min(max(int(np.searchsorted(self.x_prefix, target, side="left")), 0), stop)
            # The estimate can be off by rounding; step to the exact answer.
            while start < stop and self.of(stage, start, stop) > limit:
                start += 1
            while start > 0 and self.of(stage, start - 1, stop) <= limit:
                start -= 1
            return start
        lo, hi = 0, stop
        while lo < hi:
            mid = (lo + hi) // 2
            if self.of(stage, mid, stop) <= limit:
                hi = mid
            else:
                lo = mid + 1
        return lo


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
            merged: list[_Interval] = []
            for lo, hi in ends:
                if lo > hi:
                    continue
                if merged and lo <= merged[-1][1] + 1:
                    if hi > merged[-1][1]:
                        merged[-1] = (merged[-1][0], hi)
                else:
                    merged.append((lo, hi))
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
