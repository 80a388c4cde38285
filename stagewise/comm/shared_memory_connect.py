"""Connecting a shared-memory wire: only where every rank of the group can reach every other's shared memory."""

from __future__ import annotations

import logging
import os
import secrets
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from stagewise.comm import shared_memory_files as files
from stagewise.comm.shared_memory import SharedMemoryWire
from stagewise.comm.timeouts import DEFAULT_TIMEOUT

log = logging.getLogger(__name__)


def connect_shared_memory(group: dist.ProcessGroup, rank: int, timeout: float | None = None) -> SharedMemoryWire | None:
    """A wire between the ranks of ``group`` (collective), or None where some pair of them shares no memory.

    Each rank makes a folder with a random token in it; the wire is made
    only if every rank can read every other's token, so ranks on other
    hosts, or in containers that do not share ``/dev/shm``, keep gloo.
    ``timeout`` bounds a write to a full pipe, in seconds: by default the
    group's (a transport's group has the transport's timeout).
    """
    if not hasattr(os, "mkfifo"):
        return None
    folder = files.new_folder()
    token = secrets.token_hex(16)
    (folder / "token").write_text(token)
    everyone: list[tuple[int, str, str] | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, (rank, str(folder), token), group=group)
    folders = {r: Path(f) for r, f, _ in everyone}  # type: ignore[misc]
    readable = all(_reads(Path(f) / "token", t) for _, f, t in everyone)  # type: ignore[misc]
    votes: list[bool | None] = [None] * len(everyone)
    dist.all_gather_object(votes, readable, group=group)
    if not all(votes):
        shutil.rmtree(folder, ignore_errors=True)
        log.info("rank %d: not every rank of the transport shares memory with the others; using gloo", rank)
        return None
    seconds = _timeout_of(group) if timeout is None else timeout
    wire = SharedMemoryWire(rank, [r for r in folders if r != rank], folders, timeout=seconds)
    try:
        wire.connect(lambda: dist.barrier(group=group))
    except BaseException:
        wire.close()
        raise
    return wire


def _timeout_of(group: dist.ProcessGroup) -> float:
    """``group``'s timeout in seconds, or the default where this torch does not tell it."""
    try:
        return float(group._get_backend(torch.device("cpu")).options._timeout.total_seconds())
    except (AttributeError, RuntimeError):
        return DEFAULT_TIMEOUT


def _reads(path: Path, token: str) -> bool:
    try:
        return path.read_text() == token
    except OSError:
        return False
