"""A checkpoint directory: the step folders in it, which of them to trust, rotation, and the lock of its one writer.

``step-NNNNNNNN`` is a complete checkpoint: it was renamed into place after
its manifest was written. ``step-NNNNNNNN.partial`` is a save in progress (or
cut off), ``step-NNNNNNNN.old`` one set aside to be deleted; neither counts.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import re
import shutil
import socket
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from stagewise.checkpoint.errors import CheckpointError
from stagewise.checkpoint.manifest import INDEX, MANIFEST, sync_folder, verify

log = logging.getLogger(__name__)

_NAME = re.compile(r"^step-(\d{8})$")
LOCK = ".lock"
"""The file whose lock the run writing a checkpoint directory holds (see :class:`WriterLock`)."""


def step_folder(directory: str | Path, step: int) -> Path:
    """The folder of step ``step``'s checkpoint in ``directory``."""
    return Path(directory) / f"step-{step:08d}"


def step_of(folder: Path) -> int:
    """The step of a checkpoint's folder."""
    found = _NAME.match(folder.name)
    if found is None:
        raise ValueError(f"{folder} is not named as a checkpoint (step-NNNNNNNN)")
    return int(found.group(1))


def complete(directory: str | Path) -> list[Path]:
    """The complete checkpoints under ``directory``, oldest first: renamed into place with their manifest (or,
    written before manifests, their index). Their files are not checked: see :func:`choose`."""
    root = Path(directory)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if _NAME.match(p.name) and ((p / MANIFEST).is_file() or (p / INDEX).is_file())]
    return sorted(found, key=lambda p: p.name)


def latest(directory: str | Path) -> Path | None:
    """The newest complete checkpoint under ``directory``, or None (its files unchecked: see :func:`choose`)."""
    done = complete(directory)
    return done[-1] if done else None


@dataclass(frozen=True)
class Refused:
    """A checkpoint :func:`choose` passed over, and why."""

    path: Path
    reason: str


@dataclass(frozen=True)
class Choice:
    """What :func:`choose` found: the checkpoint to resume from, and the newer ones it refused."""

    path: Path | None
    """The newest checkpoint that verifies; None: there is none."""
    refused: tuple[Refused, ...] = ()
    """Newer checkpoints that did not verify, newest first."""

    def describe(self) -> str:
        """One line per refused checkpoint, and which one is used instead."""
        instead = f"resuming from {self.path.name} instead" if self.path else "no earlier checkpoint verifies"
        return "; ".join(f"checkpoint {r.path} refused: {r.reason}" for r in self.refused) + f"; {instead}"


def choose(directory: str | Path, *, checksums: bool) -> Choice:
    """The newest checkpoint in ``directory`` whose files match its manifest (sizes, and CRC-32 with
    ``checksums``); a newer broken one is refused with a logged warning that names it, the reason, and the
    checkpoint used instead."""
    refused: list[Refused] = []
    for path in reversed(complete(directory)):
        problem = verify(path, checksums=checksums)
        if problem is None:
            choice = Choice(path, tuple(refused))
            break
        refused.append(Refused(path, problem))
    else:
        choice = Choice(None, tuple(refused))
    if refused:
        log.warning("%s", choice.describe())
    return choice


def set_aside(folder: Path) -> Path:
    """Rename ``folder`` to ``<name>.old`` (replacing an older one), so that it stops counting at once."""
    stale = folder.with_name(folder.name + ".old")
    shutil.rmtree(stale, ignore_errors=True)
    os.replace(folder, stale)
    return stale


def rotate(directory: Path, keep: int, newest: Path) -> None:
    """Keep the newest ``keep`` complete checkpoints (``newest`` always): each older one is renamed aside first,
    then deleted, so that no half-deleted folder ever looks complete; leftovers of cut-off saves go too."""
    for old in complete(directory)[:-keep] if keep > 0 else []:
        if old != newest:  # never the one just written, whatever newer ones lie beside it
            set_aside(old)
    sync_folder(directory)
    for left in directory.glob("step-*.*"):  # saves cut off before, and folders set aside
        if left.is_dir() and left.suffix in (".partial", ".old") and left.name != f"{newest.name}.partial":
            shutil.rmtree(left, ignore_errors=True)


class WriterLock:
    """An exclusive lock on a checkpoint directory, held by the one run that writes it (by its rank 0).

    An advisory ``flock`` on ``DIR/.lock``, which names the holder (host and
    pid); the system drops it when the holder's process ends, however it ends,
    so a killed run never leaves the directory locked.
    """

    def __init__(self, directory: str | Path) -> None:
        self.path = Path(directory) / LOCK
        self._fd: int | None = None

    def acquire(self) -> WriterLock:
        """Take the lock, or raise :class:`CheckpointError` naming the run that holds it."""
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            os.close(fd)
            if err.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                raise CheckpointError(f"cannot lock the checkpoint directory {self.path.parent}: {err}") from err
            holder = self.path.read_text().strip() or "another process"
            raise CheckpointError(
                f"the checkpoint directory {self.path.parent} is being written by another run ({holder}); wait for "
                "it to end, or give this run a directory of its own (--checkpoint-dir, or --out)"
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode())
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, 0)
            os.close(self._fd)  # closing drops the lock
            self._fd = None

    def __enter__(self) -> WriterLock:
        return self.acquire()

    def __exit__(self, *exc: type[BaseException] | BaseException | TracebackType | None) -> None:
        self.release()


def check_unlocked(directory: str | Path) -> None:
    """Raise :class:`CheckpointError` now if another run writes ``directory`` (a launcher's check before it
    starts any process); a directory that does not exist yet is free."""
    if Path(directory).is_dir():
        WriterLock(directory).acquire().release()
