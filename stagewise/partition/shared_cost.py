"""Tie: an amount that several layers each count, and that a stage holding any of them counts once."""

from __future__ import annotations

import bisect
import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from stagewise.errors import is_whole


@dataclass(frozen=True)
class Tie:
    """An amount that the per-layer value of several layers includes, and that a stage holding any of them
    counts once.

    A tied parameter (an embedding and an LM head that share one matrix):
    each layer that uses it counts its parameters, but a stage keeps one
    copy. ``balance`` takes ties in the units of its weights, and a
    :class:`~stagewise.partition.MemoryModel` in bytes of its ``fixed``.
    """

    layers: tuple[int, ...]
    """The layers whose value includes it: distinct chain indices, ascending."""
    amount: float
    """What each of those layers' value includes: finite and >= 0; a layer's ties add up to at most its value (up to
    rounding)."""

    def repeated(self, layers: Collection[int]) -> float:
        """What ``layers`` count of it beyond once: its amount for each of its layers among them but one."""
        return self.amount * max(sum(i in layers for i in self.layers) - 1, 0)

    def holds(self, start: int, stop: int) -> bool:
        """Whether layers ``start:stop`` include one of :attr:`layers` or more."""
        i = bisect.bisect_left(self.layers, start)
        return i < len(self.layers) and self.layers[i] < stop


_ROUNDING = 1e-12
"""How far a layer's ties may add up beyond its value: ``nbytes * 1.3`` of two tied tensors can round to an ulp
more than the layer's ``param_bytes * 1.3``."""


def check_ties(field: str, ties: Sequence[Tie], values: Sequence[float]) -> tuple[Tie, ...]:
    """``ties`` as a tuple, refused with what is wrong when one does not fit the per-layer ``values``."""
    n = len(values)
    held = [0.0] * n  # per layer: the ties it includes, added up
    for k, tie in enumerate(ties):
        if not isinstance(tie, Tie):
            raise TypeError(f"{field}[{k}] must be a stagewise.partition.Tie, got {type(tie).__name__}")
        layers = tie.layers
        if not layers or any(not is_whole(i) for i in layers):
            raise ValueError(f"{field}[{k}].layers must be one or more whole layer indices, got {layers!r}")
        if list(layers) != sorted(set(layers)) or layers[0] < 0 or layers[-1] >= n:
            raise ValueError(
                f"{field}[{k}].layers is {list(layers)}; give distinct indices in ascending order, from 0 to {n - 1}"
            )
        if not 0 <= tie.amount < math.inf:  # also refuses NaN
            raise ValueError(f"{field}[{k}].amount must be finite and >= 0, got {tie.amount!r}")
        for i in layers:
            held[i] += tie.amount
            if held[i] > values[i] * (1 + _ROUNDING):
                raise ValueError(
                    f"{field}[{k}] makes the ties of layer {i} add up to {held[i]!r}, more than its own value "
                    f"{values[i]!r}; a tie is part of each of its layers' values, so a layer's ties add up to at "
                    "most its value"
                )
    return tuple(ties)
