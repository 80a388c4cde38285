"""The one timeout: how long any rank waits for another, in seconds, with its one default."""

from __future__ import annotations

import math

from stagewise.errors import is_whole

DEFAULT_TIMEOUT = 300.0
"""Seconds a rank waits for another (a transfer, a collective, the processes' start) before a named error."""


def checked_timeout(value: object, *, what: str = "timeout") -> float:
    """``value`` as seconds, refused unless it is a positive, finite number.

    Raises:
        TypeError: not a number (a bool, a string, a timedelta).
        ValueError: zero, negative, infinite or NaN.
    """
    if not (is_whole(value) or isinstance(value, float)):
        raise TypeError(f"{what} must be a number of seconds, got {value!r} ({type(value).__name__})")
    seconds = float(value)  # a whole number or a float
    if not 0 < seconds < math.inf:  # also refuses NaN
        raise ValueError(f"{what} must be a positive, finite number of seconds, got {value!r}")
    return seconds
