"""A launched process among its own: whether its launcher is gone, and which of the job's local ranks are stopped.

Both read /proc (Linux); elsewhere the launcher is never seen to go and no
rank is seen stopped.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

WATCH_INTERVAL = 0.25
"""Seconds between a launched process's looks at whether its parent is still there."""


def _stat_fields(pid: int) -> list[str] | None:
    """The fields of /proc/<pid>/stat after the command's name (state first), or None when it cannot be read."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2 :].split()


RANKS_DIR = "STAGEWISE_RANKS_DIR"
"""Set by :func:`stagewise.comm.launch` in its processes: a folder where each records its pid's rank (see
:func:`record_rank`), so that a peer can name a rank by its pid."""


def record_rank(rank: int) -> None:
    """Record that this process is ``rank`` of the job, where its peers look (:data:`RANKS_DIR`)."""
    folder = os.environ.get(RANKS_DIR)
    if folder:
        Path(folder, f"pid-{os.getpid()}").write_text(str(rank))


def _rank_of(pid: int) -> int | None:
    folder = os.environ.get(RANKS_DIR)
    try:
        return int(Path(folder, f"pid-{pid}").read_text()) if folder else None
    except (OSError, ValueError):
        return None


@dataclass(frozen=True)
class Stopped:
    """A process of this job that is stopped."""

    pid: int
    rank: int | None
    """Its rank, where it recorded one (:func:`record_rank`)."""

    def __str__(self) -> str:
        return f"rank {self.rank}" if self.rank is not None else f"pid {self.pid}"


def stopped_siblings() -> list[Stopped]:
    """This process's siblings (its launcher's other children: the job's other local ranks) that are stopped, by
    SIGSTOP, a terminal's Ctrl-Z or a debugger. A stopped peer never answers, so a collective that waits on it
    times out without knowing why: this says why."""
    parent, me = os.getppid(), os.getpid()
    found = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for name in entries:
        if not name.isdigit() or int(name) == me:
            continue
        fields = _stat_fields(int(name))
        if fields is not None and int(fields[1]) == parent and fields[0] in ("T", "t"):
            found.append(Stopped(int(name), _rank_of(int(name))))
    return sorted(found, key=lambda s: (s.rank is None, s.rank or 0, s.pid))


def name_stopped(err: BaseException, stopped: list[Stopped]) -> None:
    """Add to ``err``'s message which of this job's processes are stopped (see :func:`stopped_siblings`)."""
    if not stopped or not err.args or not isinstance(err.args[0], str):
        return
    which = ", ".join(str(s) for s in stopped)
    err.args = (
        f"{err.args[0]}; {which} {'is' if len(stopped) == 1 else 'are'} stopped (SIGSTOP, Ctrl-Z or a debugger), so "
        f"{'it' if len(stopped) == 1 else 'they'} never answered",
        *err.args[1:],
    )


def wake(stopped: list[Stopped]) -> None:
    """Let the stopped processes of a failing job run again (SIGCONT), so that they can act on the SIGTERM with
    which torch's agent stops the job: a stopped process cannot, and the agent waits 30 s before its SIGKILL."""
    for process in stopped:
        with contextlib.suppress(OSError):
            os.kill(process.pid, signal.SIGCONT)


def watch_parent(on_gone: Callable[[], None], interval: float = WATCH_INTERVAL) -> threading.Thread:
    """A daemon thread that calls ``on_gone`` and ends this process (exit code 1) once its parent, the launcher,
    is gone (killed, say): then nothing would stop this process, which could wait on its peers, or train on,
    for as long as its timeouts allow."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(interval)
        try:
            log.error("the launcher (pid %d) is gone; rank %s exits", parent, os.environ.get("RANK", "?"))
            on_gone()
        finally:
            os._exit(1)

    thread = threading.Thread(target=watch, name="stagewise-parent-watch", daemon=True)
    thread.start()
    return thread
