"""Stop requests: SIGTERM (a cluster's preemption) or SIGINT (Ctrl-C) end a run at the end of its step, saved."""

from __future__ import annotations

import signal
import threading
import time
from types import FrameType, TracebackType
from typing import Literal

import torch
import torch.distributed as dist

StopSignal = Literal["SIGINT", "SIGTERM"]
"""The signals that ask a run to stop."""

_CODES: dict[StopSignal, int] = {"SIGINT": 1, "SIGTERM": 2}
"""Agreed over the ranks as a maximum: SIGTERM, which asks for a clean exit, wins over SIGINT."""

REPEAT_WINDOW = 2.0
"""Seconds within which a second signal is the same request delivered twice (to the process group, and again
by the launcher that passes it on); one after them stops at once."""


class StopSignals:
    """Within, SIGTERM and SIGINT ask the run to stop at the end of its current step instead of ending it.

    The training loop asks :meth:`agreed` after each step; every rank gets the
    same answer, so all stop after the same step. A second signal, more than
    :data:`REPEAT_WINDOW` seconds after the first, stops at once as without
    this: SIGINT raises :class:`KeyboardInterrupt`, SIGTERM terminates. Outside
    the main thread (where Python cannot set handlers) it does nothing.
    """

    def __init__(self) -> None:
        self.requested: StopSignal | None = None
        """The signal this process received first; None while none has come."""
        self._at = 0.0
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(
        self, kind: type[BaseException] | None, value: BaseException | None, traceback: TracebackType | None
    ) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.requested is None:
            self.requested = "SIGTERM" if signum == signal.SIGTERM else "SIGINT"
            self._at = time.monotonic()
            return
        if time.monotonic() - self._at < REPEAT_WINDOW:
            return
        signal.signal(signum, signal.SIG_DFL)
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        signal.raise_signal(signum)

    def agreed(self, device: torch.device) -> StopSignal | None:
        """Whether any rank was asked to stop, and by which signal (SIGTERM first); the same on every rank.
        A collective of the default group when there is one."""
        code = _CODES[self.requested] if self.requested is not None else 0
        if dist.is_initialized():
            flag = torch.tensor([code], dtype=torch.int32, device=device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            code = int(flag.item())
        return next((name for name, value in _CODES.items() if value == code), None)
