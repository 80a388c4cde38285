"""What a failed launch reports: every failed rank with its error, traceback and place, the first to fail first."""

from __future__ import annotations

import contextlib
import math
import os
import signal
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure, get_error_handler

from stagewise.comm.layout import Layout
from stagewise.errors import JobFailureError


@dataclass(frozen=True)
class RankFailure:
    """How one rank of a launched job failed."""

    rank: int
    """Global rank."""
    exitcode: int | None
    """Its exit code, negative for a signal; None for a rank that raised after the failure the agent noticed, and
    that the agent stopped before it exited."""
    message: str
    """The exception (``ValueError: ...``) or the signal it died of."""
    traceback: str
    """The rank's Python traceback, or the end of its stderr, when there is one."""
    where: str = ""
    """Its place in the job, e.g. ``stage 1, replica 0``, when the launch was given the layout."""

    @property
    def who(self) -> str:
        return f"rank {self.rank} ({self.where})" if self.where else f"rank {self.rank}"

    @property
    def how(self) -> str:
        """``(exit code N): message``, or just ``: message`` when the exit code is not known."""
        code = "" if self.exitcode is None else f" (exit code {self.exitcode})"
        return f"{code}: {self.message}"


class LaunchError(JobFailureError):
    """A launched job failed; ``failures`` lists every failed rank, the first to fail first."""

    def __init__(self, failures: Sequence[RankFailure]) -> None:
        self.failures = tuple(failures)
        first = self.failures[0]
        lines = [f"{first.who} failed{first.how}"]
        self.headline = lines[0].splitlines()[0]
        """The first failure in one line: the rank, its place, and the first line of its cause."""
        if first.traceback:
            lines.append(first.traceback.rstrip())
        for other in self.failures[1:]:
            lines.append(f"{other.who} also failed{other.how}")
        super().__init__("\n".join(lines))

    def __reduce__(self) -> tuple[type[LaunchError], tuple[tuple[RankFailure, ...]]]:
        return (LaunchError, (self.failures,))


def _attempt(folder: Path) -> int:
    """The number of the agent's ``attempt_N`` folder (attempt_10 comes after attempt_9); -1 for another folder."""
    number = folder.name.removeprefix("attempt_")
    return int(number) if number.isdigit() else -1


def stderr_tail(log_dir: Path, local_rank: int, lines: int = 30) -> str:
    """The last ``lines`` of a local rank's stderr in its latest attempt, from the agent's logs under ``log_dir``."""
    logs = sorted(log_dir.glob(f"**/attempt_*/{local_rank}/stderr.log"), key=lambda p: _attempt(p.parent.parent))
    if not logs:
        return ""
    text = logs[-1].read_text(errors="replace").splitlines()
    return "\n".join(text[-lines:])


def _failed_at(failure: ProcessFailure) -> float:
    """When a rank failed, to list the first failure first.

    A rank that raised wrote an error file: its write time, finer than the
    whole seconds the agent records. One without that exited by itself or
    was killed (by the kernel, say) is the failure the agent noticed, and it
    noticed it before any rank that raised had exited (those wait
    :data:`stagewise.comm.launched_process.FAILURE_GRACE`): it comes first. One that
    died of SIGTERM without an error file is one the agent stopped after the
    first failure: it comes last.
    """
    if os.path.isfile(failure.error_file):
        return os.stat(failure.error_file).st_mtime
    return math.inf if failure.exitcode == -signal.SIGTERM else -math.inf


def _raised_unrecorded(failures: Mapping[int, ProcessFailure], log_dir: Path) -> dict[int, ProcessFailure]:
    """The ranks of the agent's last attempt that raised, but that the agent did not record.

    The agent records only the first failed process it notices, and stops the
    others. Every rank that raised left an error file in the last attempt's
    folder of our log directory before it lingered (:data:`stagewise.comm.launched_process.FAILURE_GRACE`).
    """
    attempts = [p for p in log_dir.glob("*/attempt_*") if _attempt(p) >= 0]
    if not failures or not attempts:
        return {}
    latest = max(attempts, key=_attempt)
    rank, failure = next(iter(failures.items()))
    offset = rank - failure.local_rank  # ranks of one node are consecutive
    known = {f.local_rank for f in failures.values()}
    found = {}
    for error_file in latest.glob("*/error.json"):
        local = error_file.parent.name
        if local.isdigit() and int(local) not in known:
            # The exit code is not known: the agent stopped it (pid and exit code here are placeholders).
            found[offset + int(local)] = ProcessFailure(int(local), pid=-1, exitcode=1, error_file=str(error_file))
    return found


def failures_of(err: ChildFailedError, log_dir: Path, layout: Layout | None = None) -> list[RankFailure]:
    """Every failed rank of the agent's ``err``, with ranks it stopped after they raised; the first to fail first."""
    found = []
    stopped = _raised_unrecorded(err.failures, log_dir)
    every = {**err.failures, **stopped}
    for rank, failure in sorted(every.items(), key=lambda item: (_failed_at(item[1]), item[0])):
        message: Any = failure.message
        if isinstance(message, dict):
            text = str(message.get("message", ""))
            trace = str(message.get("extraInfo", {}).get("py_callstack", ""))
        else:
            text, trace = str(message), ""
        if not trace:
            trace = stderr_tail(log_dir, failure.local_rank)
        where = ""
        if layout is not None and 0 <= rank < layout.world_size:
            place = layout.coords(rank)
            where = f"stage {place.stage}, replica {place.replica}"
            if layout.fsdp > 1:
                where += f", shard {place.shard}"
            if layout.tp > 1:
                where += f", tp rank {place.tp_rank}"
        exitcode = None if rank in stopped else failure.exitcode
        if exitcode is not None and exitcode < 0 and not text:
            text = f"killed by signal {-exitcode}"
        found.append(RankFailure(rank, exitcode, text, trace, where))
    return found


def report(err: BaseException) -> None:
    """Write torch elastic's error file for ``err`` whole or not at all, so that the agent never reads half of one.

    The agent may stop this process (a peer died first) while it writes; the
    file is written under another name and renamed into place.
    """
    path = os.environ.get(ERROR_FILE)
    if not path:
        get_error_handler().record_exception(err)
        return
    os.environ[ERROR_FILE] = path + ".partial"
    try:
        get_error_handler().record_exception(err)
    finally:
        os.environ[ERROR_FILE] = path
    with contextlib.suppress(FileNotFoundError):
        os.replace(path + ".partial", path)


ERROR_FILE = "TORCHELASTIC_ERROR_FILE"
"""Where torch elastic's agent reads a failed rank's report (set by the agent for each rank)."""
