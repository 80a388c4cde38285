"""A checkpoint's manifest: every file's size and CRC-32, written before the rename that completes the checkpoint.

Each rank records the data files it wrote (DCP names them ``__RANK_N.distcp``)
in a part of its own; rank 0 seals the parts, with the index, into
``manifest.json``, written atomically and synced before the checkpoint's
folder is renamed into place. :func:`verify` checks a checkpoint against it:
the files' sizes always (a stat each), their CRC-32 when asked (a read of
every byte, at about 6 GB/s from the page cache here).
"""

from __future__ import annotations

import json
import logging
import os
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
"""The manifest's file name in a checkpoint's folder."""
INDEX = ".metadata"
"""DCP's index of a checkpoint."""
FORMAT = 1
_CHUNK = 8 << 20


@dataclass(frozen=True)
class FileRecord:
    """One file of a checkpoint as it was written."""

    size: int
    """Bytes."""
    crc32: int
    """zlib's CRC-32 of its bytes."""


def record_of(path: Path) -> FileRecord:
    """The size and CRC-32 of the file at ``path``, read once."""
    crc, size = 0, 0
    with path.open("rb") as file:
        while chunk := file.read(_CHUNK):
            crc, size = zlib.crc32(chunk, crc), size + len(chunk)
    return FileRecord(size, crc)


def write_atomically(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file, synced and renamed into place, and sync its folder."""
    staged = path.with_name(f".{path.name}.partial")
    with staged.open("w") as file:
        file.write(text)
        file.flush()
        os.fsync(file.fileno())
    os.replace(staged, path)
    sync_folder(path.parent)


def sync_folder(folder: Path) -> None:
    """Make the entries of ``folder`` (names made, renamed or removed) durable."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _part(folder: Path, rank: int) -> Path:
    return folder / f".manifest-{rank}.json"


def _own_files(folder: Path, rank: int) -> list[Path]:
    return sorted(folder.glob(f"__{rank}_*"))


def record_part(folder: Path, rank: int) -> None:
    """Record the data files rank ``rank`` wrote into ``folder``, each synced to disk, in its part."""
    records = {}
    for path in _own_files(folder, rank):
        with path.open("rb") as file:
            os.fsync(file.fileno())
        records[path.name] = asdict(record_of(path))
    write_atomically(_part(folder, rank), json.dumps(records))


def seal(folder: Path, world: int, step: int) -> None:
    """Rank 0: gather the ``world`` ranks' parts and the index into ``folder``'s manifest (any data file no part
    names is recorded here), then remove the parts."""
    files: dict[str, dict[str, int]] = {}
    for rank in range(world):
        files.update(json.loads(_part(folder, rank).read_text()))
    for path in [folder / INDEX, *sorted(folder.glob("__*"))]:
        if path.name not in files:
            files[path.name] = asdict(record_of(path))
    write_atomically(folder / MANIFEST, json.dumps({"format": FORMAT, "step": step, "files": files}, indent=1))
    for rank in range(world):
        _part(folder, rank).unlink()


def verify(folder: Path, *, checksums: bool) -> str | None:
    """Why the checkpoint in ``folder`` cannot be trusted, or None: its manifest must list its files with their
    sizes (and, with ``checksums``, their CRC-32). A checkpoint from before manifests (an index, no manifest)
    passes with a logged warning: it cannot be checked."""
    path = folder / MANIFEST
    if not path.is_file():
        if (folder / INDEX).is_file():
            log.warning("%s has no manifest (written before stagewise recorded one): its files are not checked", folder)
            return None
        return "it has neither a manifest nor an index (not a checkpoint)"
    try:
        manifest = json.loads(path.read_text())
        files = {name: FileRecord(**fields) for name, fields in manifest["files"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        return f"its manifest {path} is unreadable ({type(err).__name__}: {err})"
    for name, expected in sorted(files.items()):
        problem = _check(folder / name, expected, checksums)
        if problem:
            return problem
    return None


def _check(path: Path, expected: FileRecord, checksums: bool) -> str | None:
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return f"its file {path.name} is missing"
    except OSError as err:
        return f"its file {path.name} cannot be read ({err.strerror})"
    if size != expected.size:
        return f"its file {path.name} has {size} bytes, but {expected.size} were written"
    if checksums:
        try:
            found = record_of(path)
        except OSError as err:
            return f"its file {path.name} cannot be read ({err.strerror})"
        if found.crc32 != expected.crc32:
            return (
                f"its file {path.name} has changed since it was written "
                f"(CRC-32 {found.crc32:08x}, not {expected.crc32:08x})"
            )
    return None
