"""Byte sizes: read "80GiB"-style strings and write them back for people."""

from __future__ import annotations

import math
import re

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(text: str) -> float:
    """Bytes in ``text``: a number with an optional unit (B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)."""
    match = _SIZE.match(text)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _UNITS:
        raise ValueError(
            f"cannot read {text!r} as a size; write a number with an optional unit, e.g. 80GiB, 40GB or 8e10"
        )
    value = float(match.group(1)) * _UNITS[unit]
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"a size must be positive and finite, got {text!r}")
    return value


def format_bytes(value: float) -> str:
    """``value`` bytes with a binary unit, e.g. ``1.50 GiB``."""
    if not math.isfinite(value):
        return str(value)
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(value) >= size:
            return f"{value / size:.2f} {unit}"
    return f"{value:.0f} B"
