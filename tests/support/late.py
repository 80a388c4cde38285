"""Make one rank late to a step of the pipeline, and report the named error the others raise."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any

from stagewise.comm import CommError


def late(fn: Callable[..., Any], seconds: float) -> Callable[..., Any]:
    """``fn``, called ``seconds`` late."""

    @functools.wraps(fn)
    def delayed(*args: Any, **kwargs: Any) -> Any:
        time.sleep(seconds)
        return fn(*args, **kwargs)

    return delayed


def comm_error(call: Callable[[], object]) -> str:
    """``call()``'s communication error as ``"Type: message"``, or ``"no error"``."""
    try:
        call()
    except CommError as err:
        return f"{type(err).__name__}: {err}"
    return "no error"
