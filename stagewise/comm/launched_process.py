"""What each launched process runs around the launched function: its set-up, its failure report, its result."""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable, Mapping
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch

from stagewise.comm.cpu_pinning import pin
from stagewise.comm.launch_failures import report
from stagewise.comm.process_tree import name_stopped, record_rank, stopped_siblings, wake, watch_parent
from stagewise.comm.shared_memory_files import remove_made
from stagewise.comm.stop_signals import fresh_stop_signals

FAILURE_GRACE = 1.0
"""Seconds a failing rank of :func:`~stagewise.comm.launcher.launch` waits, its report written, before it exits.

Its peers fail soon after it exits, on the closed connection, and the agent
records only the first failure it notices. A rank killed by a signal writes
no report, so its peers wait this long for the agent to notice it first.
"""


class LaunchedFunction:
    """Calls ``fn`` in a launched process and checks that its result can travel back to the launcher.

    It first sets the job's environment variables and intra-op threads (a
    process forked from a fork server that imported torch before they were
    set would not see them) and, with ``pin_cores``, the CPUs of every
    thread. The agent pickles each rank's result after ``fn`` has returned,
    outside the scope that records a rank's exception, so an unpicklable
    result (a tensor attached to an autograd graph) would fail without its
    cause. A rank that fails writes its report at once (naming the job's
    ranks that are stopped, whose silence timed it out), then waits
    ``grace`` seconds before it exits (see :data:`FAILURE_GRACE`) and lets
    the stopped ranks run again, so that the agent's SIGTERM ends them. A
    rank interrupted (SIGINT) or calling ``sys.exit`` fails the same way: torch's
    process wrapper would otherwise exit with code 0 and no result, and the
    agent would wait for that result forever. A rank whose launcher is gone
    (killed alone) removes its shared memory and exits within a quarter of a
    second.
    """

    def __init__(self, fn: Callable[..., Any], env: Mapping[str, str], threads: int | None, grace: float) -> None:
        self.fn = fn
        self.env = dict(env)
        self.threads = threads
        self.grace = grace
        self.cores: list[frozenset[int]] = []
        """Per local rank, the CPUs it may run on (``pin_cores``); empty: wherever the OS places it."""
        functools.update_wrapper(self, fn)  # the agent names the job after fn

    def __call__(self, *args: Any) -> Any:
        fresh_stop_signals()
        watch_parent(remove_made)  # a launcher killed alone: its ranks go too, and their shared memory with them
        os.environ.update(self.env)
        record_rank(int(os.environ.get("RANK", "-1")))
        if self.cores:
            pin(self.cores[int(os.environ["LOCAL_RANK"])])
        if self.threads is not None:
            torch.set_num_threads(self.threads)
        try:
            try:
                return self._checked(self.fn(*args))
            except KeyboardInterrupt as err:  # torch's process wrapper would exit 0 without a result: a hang
                raise RuntimeError("interrupted (KeyboardInterrupt, or SIGINT)") from err
            except SystemExit as err:  # the same
                raise RuntimeError(
                    f"called sys.exit({err.code!r}) instead of returning; return a value or raise an exception"
                ) from err
        except Exception as err:
            stopped = stopped_siblings()
            name_stopped(err, stopped)  # a peer stopped (SIGSTOP) times a collective out: say which
            report(err)  # now: the agent may stop this process while it waits
            time.sleep(self.grace)
            wake(stopped)  # so that the agent's SIGTERM ends them now, not 30 s later
            raise

    def _checked(self, result: Any) -> Any:
        try:
            ForkingPickler.dumps(result)
        except Exception as err:
            name = getattr(self.fn, "__name__", "the function")
            raise TypeError(
                f"{name} returned a value that cannot be sent back to the launcher: "
                f"{type(err).__name__}: {err}; return plain values (detach tensors, drop modules and groups)"
            ) from err
        return result
