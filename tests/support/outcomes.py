"""Many cases run in one launch, each outcome kept apart, so that one failing case fails its own test."""

from __future__ import annotations

import traceback
from collections.abc import Callable, Iterable
from typing import Any, Protocol, TypeVar


class Named(Protocol):
    @property
    def name(self) -> str: ...


C = TypeVar("C", bound=Named)


def each_case(train: Callable[[C], Any], cases: Iterable[C]) -> dict[str, Any]:
    """``train(case)`` of every case by the case's name, or the traceback it raised (reported by its own test)."""
    out: dict[str, Any] = {}
    for case in cases:
        try:
            out[case.name] = train(case)
        except Exception:
            out[case.name] = traceback.format_exc()
    return out
