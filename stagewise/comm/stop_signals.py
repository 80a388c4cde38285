"""The stop signals (SIGTERM, SIGINT) of a launch: passed on to its processes, and fresh in each of them."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import threading
from collections.abc import Iterator
from types import FrameType


def _pass_on(signum: int, frame: FrameType | None) -> None:
    for child in multiprocessing.active_children():  # the agent's worker processes are this process's children
        with contextlib.suppress(ProcessLookupError):
            os.kill(child.pid, signum)  # type: ignore[arg-type]


@contextlib.contextmanager
def passing_stop_signals(active: bool) -> Iterator[None]:
    """Within, SIGTERM and SIGINT to this process go on to its processes (see ``pass_stop_signals``)."""
    if not active or threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, _pass_on) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def fresh_stop_signals() -> None:
    """The stop signals' handlers of a fresh interpreter (SIGINT raises KeyboardInterrupt, the others stop the
    process): a process forked from the agent (``start_method="fork"``) would keep the agent's own."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for name in ("SIGTERM", "SIGHUP", "SIGQUIT"):
        signal.signal(getattr(signal, name), signal.SIG_DFL)
