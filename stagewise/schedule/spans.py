"""Spans of time a rank spent on something other than an action (waiting for a transfer), for traces."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Span:
    """A named stretch of time on one rank, e.g. ``wait 1B3`` while a gradient is in flight."""

    rank: int
    name: str
    category: str
    """Groups spans in a trace viewer: "wait" for transfers."""
    start: float
    end: float
