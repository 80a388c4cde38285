"""RangeCost: what a contiguous range of layers costs on a stage, from prefix sums, monotone to the bit."""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from stagewise.partition.shared_cost import Tie

FloatArray = npt.NDArray[np.float64]


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
    _x: list[float] = field(init=False, repr=False, compare=False)
    _y: tuple[list[float], ...] = field(init=False, repr=False, compare=False)
    _begin: tuple[list[float] | None, ...] = field(init=False, repr=False, compare=False)
    _scale: list[float] | None = field(init=False, repr=False, compare=False)
    _divisor: list[float] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # Python floats mirroring the arrays, for :meth:`of` in the solver's inner loop: the same IEEE doubles
        # and the same operations as on numpy's scalars (so the same bits), without numpy's cost per element.
        mirror = object.__setattr__
        mirror(self, "_x", self.x_prefix.tolist())
        mirror(self, "_y", tuple(y.tolist() for y in self.y_prefix))
        mirror(self, "_begin", tuple(None if g is None else g.tolist() for g in self.starts))
        mirror(self, "_scale", None if self.scale is None else self.scale.tolist())
        mirror(self, "_divisor", self.divisor.tolist())

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

    def _sum(self, t: int, start: int, stop: int) -> float:
        """``y_t`` summed over layers ``start:stop``, with the head of ``start`` when the range is not empty."""
        y = self._y[t]
        begin = self._begin[t] if self._begin else None
        if begin is None or stop <= start:
            return y[stop] - y[start]
        return y[stop] - begin[start]

    def of(self, stage: int, start: int, stop: int) -> float:
        """Cost of layers ``start:stop`` on ``stage``."""
        x = self._x
        total = x[stop] - x[start]
        for tie in self.ties:
            if tie.holds(start, stop):
                total = total + tie.amount
        if self._y:
            scale = self._scale
            if scale is not None:  # the common case, in the solver's inner loop
                total = total + scale[stage] * self._sum(0, start, stop)
            elif len(self.y_prefix) == 2:  # activations and pooled bytes: the same sums as _weighted, inlined
                dy, dz = self._sum(0, start, stop), self._sum(1, start, stop)
                total = total + max(a * dy + b * dz for a, b in self.forms[stage])
            else:
                sums = [self._sum(t, start, stop) for t in range(len(self.y_prefix))]
                total = total + max(_weighted(form, sums) for form in self.forms[stage])
        return float(total / self._divisor[stage])

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
