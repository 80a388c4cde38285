"""The shared-memory wire's segments: this rank's, made at random names and reused by size, and its peers', mapped.

Each message is copied into a segment of shared memory (a file under
``/dev/shm``, mapped by both ranks). Segments are kept for reuse, powers of
two in size, so a rank holds about the most it ever had in flight to each
peer. Their files are named after their process, which removes them at exit;
what a killed process left, the next wire's start removes
(:mod:`~stagewise.comm.shared_memory_files`). Each segment's name ends in a
random number, made with ``O_EXCL`` and mode 0600: a file planted in
``/dev/shm`` cannot take its place.
"""

from __future__ import annotations

import logging
import mmap
import os
import secrets
import shutil
from pathlib import Path

import torch

from stagewise.comm import shared_memory_files as files

log = logging.getLogger(__name__)

_SMALLEST = 4096  # segment sizes are powers of two from here
_TRIES = 8
"""Fresh names a new segment tries: one taken is improbable (62 random bits), eight in a row something to stop at."""


def _segment_number() -> int:
    """A new segment's number, which its file's name and its messages' records carry: random, so that no one can
    plant a file at the name a segment will take (sequential names in /dev/shm could be guessed)."""
    return secrets.randbits(62)


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f} MiB" if nbytes >= 2**20 else f"{nbytes / 2**10:.1f} KiB"


class Segments:
    """The segments a rank sends through, beside its wire's ``folder``; each serves one peer, which alone maps it."""

    def __init__(self, rank: int, folder: Path) -> None:
        self.rank = rank
        self.folder = folder
        self.made = 0
        """How many segments this rank has made."""
        self._segments: dict[int, torch.Tensor] = {}
        """This rank's segments, by number."""
        self._idle: dict[tuple[int, int], list[int]] = {}
        """Segments free for the next message, by (peer, size)."""

    def take(self, peer: int, nbytes: int) -> tuple[int, torch.Tensor]:
        """A segment for a message of ``nbytes`` to ``peer``, its number and memory: one free, or a new one."""
        size = max(_SMALLEST, 1 << max(nbytes - 1, 0).bit_length())
        idle = self._idle.get((peer, size))
        number = idle.pop() if idle else self._new(size)
        return number, self._segments[number]

    def free(self, peer: int, size: int, number: int) -> None:
        """Segment ``number``, of ``size`` bytes, is free again for ``peer``'s next message."""
        self._idle.setdefault((peer, size), []).append(number)

    def _new(self, size: int) -> int:
        number, path, fd = self._create()
        try:
            # Reserve the memory now: a sparse file on a full tmpfs would fail later, on a page, with SIGBUS.
            if hasattr(os, "posix_fallocate"):
                os.posix_fallocate(fd, 0, size)
            else:
                os.ftruncate(fd, size)
        except OSError as err:
            os.unlink(path)
            free = shutil.disk_usage(self.folder.parent).free
            raise RuntimeError(
                f"rank {self.rank} cannot reserve {_size(size)} of shared memory in {self.folder.parent} "
                f"({_size(free)} free: {err.strerror}); give the host more shared memory (docker: "
                "--shm-size), or send through gloo: set STAGEWISE_SHARED_MEMORY=0 (Transport: shared_memory=False)"
            ) from err
        finally:
            os.close(fd)
        self._segments[number] = torch.from_file(str(path), shared=True, size=size, dtype=torch.uint8)
        self.made += 1
        files.made(path)
        return number

    def _create(self) -> tuple[int, Path, int]:
        """A new segment's number, path and open descriptor: a file of this rank alone (``O_EXCL``, mode 0600) at
        a random name; a name taken (planted there, or drawn before) is drawn afresh, up to :data:`_TRIES` times."""
        for _ in range(_TRIES):
            number = _segment_number()
            path = files.segment_path(self.folder, number)
            if number in self._segments:
                continue
            try:
                return number, path, os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            except FileExistsError:
                log.warning("rank %d: %s exists, made by someone else; trying another name", self.rank, path)
        raise RuntimeError(
            f"rank {self.rank} cannot create a shared-memory segment: {_TRIES} random names in a row were taken, "
            f"the last {path}; find what creates files in {self.folder.parent}, or send through gloo: set "
            "STAGEWISE_SHARED_MEMORY=0 (Transport: shared_memory=False)"
        )

    def remove(self) -> None:
        """Drop every segment, removing those no peer received (a peer unlinks what it maps)."""
        for number in self._segments:
            files.unmade(files.segment_path(self.folder, number))
        self._segments.clear()


class Mapped:
    """Peers' segments mapped here, by (peer, segment), each on its first message (a segment keeps its size)."""

    def __init__(self, folders: dict[int, Path]) -> None:
        self._folders = folders
        self._mapped: dict[tuple[int, int], torch.Tensor] = {}

    def segment(self, peer: int, number: int) -> torch.Tensor:
        """``peer``'s segment ``number``, mapped now if it is not yet."""
        segment = self._mapped.get((peer, number))
        if segment is None:
            path = files.segment_path(self._folders[peer], number)
            try:
                with open(path, "r+b") as file:
                    # The sender's memory, mapped: no allocation of this rank's (torch.from_file would count as one).
                    segment = torch.frombuffer(mmap.mmap(file.fileno(), 0), dtype=torch.uint8)
            except OSError as err:
                raise RuntimeError(f"rank {peer}'s shared-memory segment {path} is gone ({err})") from err
            path.unlink(missing_ok=True)  # both ranks have it mapped: nothing is left behind if one dies
            self._mapped[(peer, number)] = segment
        return segment

    def clear(self) -> None:
        """Let go of every mapping."""
        self._mapped.clear()
