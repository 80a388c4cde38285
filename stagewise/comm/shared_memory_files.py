"""The shared-memory wire's files in /dev/shm: named after their owner process, removed when it is gone."""

from __future__ import annotations

import atexit
import contextlib
import functools
import logging
import multiprocessing.util
import os
import re
import shutil
import tempfile
import weakref
from pathlib import Path
from typing import Protocol

log = logging.getLogger(__name__)

_NAME = re.compile(r"stagewise-(?P<ns>\d+)-(?P<pid>\d+)-(?P<start>\d+)-[a-z0-9_]+(?:-segment-\d+)?")
"""A folder or segment of a wire: the owner's pid namespace, pid and start time, then a random part."""


class Forks(Protocol):
    """A connected wire, told when this process forks: the child must let go of the parent's pipes."""

    def forget_in_child(self) -> None: ...


def _pid_namespace() -> int:
    """This process's pid namespace (the inode of /proc/self/ns/pid), or 0 where there is no such file."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def _start_time(pid: int) -> int | None:
    """When ``pid`` started, in clock ticks after boot (field 22 of /proc/<pid>/stat, which outlives no reuse of
    the pid), 0 where there is no /proc to tell, None when there is and the process is not in it."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return None if os.path.isdir("/proc/self") else 0
    except OSError:
        return 0
    return int(stat[stat.rindex(")") + 2 :].split()[19])  # fields after the command's name start at field 3


@functools.cache
def _owner() -> tuple[int, int, int]:
    """This process's (pid namespace, pid, start time), cached per pid (a forked child looks itself up anew)."""
    return _pid_namespace(), os.getpid(), _start_time(os.getpid()) or 0


def _me() -> tuple[int, int, int]:
    owner = _owner()
    if owner[1] != os.getpid():  # forked since
        _owner.cache_clear()
        owner = _owner()
    return owner


def _alive(namespace: int, pid: int, start: int) -> bool:
    """Whether the process that owns a file still runs; one of another pid namespace is taken to (none can tell)."""
    if namespace != _me()[0]:
        return True
    started = _start_time(pid)
    if started is None:
        return False
    if started and start:
        return started == start  # another process that reuses the pid is not the owner
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_orphans(base: Path) -> list[str]:
    """Remove the wires' folders and segments in ``base`` whose owning process is gone (killed, say, before it
    could remove them); the names removed. An entry that cannot be removed (another user's, say) is logged and
    skipped: the scan goes on with the next."""
    removed = []
    try:
        with os.scandir(base) as entries:
            for entry in entries:
                try:
                    if _remove_orphan(entry):
                        removed.append(entry.name)
                except FileNotFoundError:  # another rank's start may remove it first
                    continue
                except OSError as err:
                    log.warning("cannot remove %s, left by a process that is gone; skipping it (%s)", entry.path, err)
    except OSError as err:
        log.warning("cannot scan %s for shared-memory files of processes that are gone (%s)", base, err)
    if removed:
        log.info("removed %d shared-memory file(s) of processes that are gone from %s", len(removed), base)
    return removed


def _remove_orphan(entry: os.DirEntry[str]) -> bool:
    """Remove ``entry`` if it is a wire's folder or segment whose owner is gone; whether it was."""
    found = _NAME.fullmatch(entry.name)
    if found is None or _alive(int(found["ns"]), int(found["pid"]), int(found["start"])):
        return False
    if entry.is_dir(follow_symlinks=False):
        shutil.rmtree(entry.path)
    else:
        os.unlink(entry.path)
    return True


def shared_base() -> Path:
    """Where the wires keep their files: /dev/shm (memory) where there is one, else the temporary folder."""
    writable = os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK)
    return Path("/dev/shm" if writable else tempfile.gettempdir())


def new_folder() -> Path:
    """A fresh folder for this rank's pipes while connecting (its segments go beside it), named after this
    process; first, what processes that are gone left in the same place goes."""
    base = shared_base()
    remove_orphans(base)
    namespace, pid, start = _me()
    return Path(tempfile.mkdtemp(prefix=f"stagewise-{namespace}-{pid}-{start}-", dir=base))


def segment_path(folder: Path, number: int) -> Path:
    """Where the rank of ``folder`` keeps its segment ``number`` (random: see ``SharedMemoryWire``): beside the
    folder, which goes after connecting."""
    return folder.parent / f"{folder.name}-segment-{number}"


_MADE: set[Path] = set()
"""The segment files this process made: those still there at its exit (no peer received them) are removed then."""

_LIVE: weakref.WeakSet[Forks] = weakref.WeakSet()
"""Every wire of this process, for :func:`_after_fork`."""

_WATCHING: list[int] = []
"""The process that registered :func:`remove_made` for its exit (a forked child registers its own)."""

_FORK_HOOK: list[bool] = []
"""Whether :func:`_after_fork` is registered: once per interpreter, as a forked child inherits it."""


def made(path: Path) -> None:
    """``path``, a segment of this process, is removed at its exit unless :func:`unmade` first."""
    _MADE.add(path)


def unmade(path: Path) -> None:
    """Remove ``path`` now (its wire closed)."""
    path.unlink(missing_ok=True)
    _MADE.discard(path)


def watch(wire: Forks) -> None:
    """Register ``wire`` for forks, and, for the first wire of a process, the hooks that remove its segments at
    exit and let a forked child go of its wires (nothing is registered at import)."""
    if not _FORK_HOOK and hasattr(os, "register_at_fork"):
        os.register_at_fork(after_in_child=_after_fork)
        _FORK_HOOK.append(True)
    if [os.getpid()] != _WATCHING:
        _WATCHING[:] = [os.getpid()]
        atexit.register(remove_made)
        # multiprocessing's processes leave by os._exit, past atexit; its finalizers run in the process that made them.
        multiprocessing.util.Finalize(None, remove_made, exitpriority=0)
    _LIVE.add(wire)


def unwatch(wire: Forks) -> None:
    """``wire`` is closed: its descriptors' numbers may be reused, so a later fork must not close them."""
    _LIVE.discard(wire)


def remove_made() -> None:
    """Remove every segment this process made that is still there (at its exit, or when it must end at once)."""
    for path in _MADE:
        with contextlib.suppress(OSError):
            path.unlink()
    _MADE.clear()


def _after_fork() -> None:
    for wire in list(_LIVE):
        wire.forget_in_child()
    _LIVE.clear()
    _MADE.clear()  # the parent's segments, for the parent to remove: a child's exit must not take them
