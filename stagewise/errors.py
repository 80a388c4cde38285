"""What stagewise raises: the root of its own exceptions, and the one check of a whole number a user gives.

Every exception stagewise defines is a :class:`StagewiseError`, and also the builtin type it has always been
(a ``ValueError``, ``TypeError``, ``RuntimeError`` ...), so that ``except ValueError`` keeps working and
``except stagewise.StagewiseError`` catches what stagewise itself raises. This module imports nothing, so that
every layer (the schedule layer, which imports no torch, too) may use it.
"""

from __future__ import annotations

import numbers
from typing import TypeGuard


class StagewiseError(Exception):
    """The root of every exception stagewise defines."""


class JobFailureError(StagewiseError, RuntimeError):
    """A job whose processes failed, told in one line (the launcher's report, or a command's summary of it): what
    the command line ends with exit status 1."""


def is_whole(value: object) -> TypeGuard[int]:
    """Whether ``value`` is a whole number: an int (numpy's too), not a bool (which Python counts as an int)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def whole_number(name: str, value: object, *, least: int | None = None, fix: str = "") -> int:
    """``value`` if it is a whole number of at least ``least``; else a one-line error naming ``name``: a
    TypeError for a value of another type, a ValueError for one out of range (``fix`` says how to mend it)."""
    if not is_whole(value):
        raise TypeError(f"{name} must be a whole number, got {value!r}" + (f"; {fix}" if fix else ""))
    number = int(value)
    if least is not None and number < least:
        raise ValueError(f"{name} must be >= {least}, got {number}" + (f"; {fix}" if fix else ""))
    return number
