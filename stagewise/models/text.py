"""Byte-level text data over any file or folder; by default the installed Python standard library's source."""

from __future__ import annotations

import logging
import math
import os
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils.data import Dataset

log = logging.getLogger(__name__)

DEFAULT_LIMIT = 8 << 20
"""Bytes read at most from the default corpus (the standard library): enough for the tiny presets, quick to read."""


def standard_library() -> Path:
    """The folder of the running Python's standard library, whose source is the default corpus."""
    return Path(sysconfig.get_paths()["stdlib"])


_SKIP = frozenset({"site-packages", "dist-packages", "__pycache__"})


def _files(root: Path, suffix: str | None) -> Iterator[Path]:
    """Files under ``root`` in a fixed order (folders walked in sorted order), installed packages skipped."""
    if root.is_file():
        yield root
        return
    if not root.is_dir():
        raise FileNotFoundError(f"no text file or folder at {root}; pass an existing --data path")
    for folder, dirs, names in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in _SKIP and not d.startswith("."))
        for name in sorted(names):
            if (suffix is None or name.endswith(suffix)) and not name.endswith((".pyc", ".so")):
                yield Path(folder) / name


_CHUNK = 1 << 20
"""Bytes asked for at a time beyond a file's recorded size (a file that grew, a pipe)."""


def _head(file: Path, limit: float) -> tuple[bytes, bool]:
    """The first ``limit`` bytes of ``file`` (all of it if ``limit`` is infinite), and whether it holds more.

    Nothing past them is read, but one byte to tell whether there is more. ``read(n)`` allocates ``n`` bytes
    before it reads, so it is asked for no more than the file's size, then for small chunks.
    """
    with file.open("rb") as f:
        if limit == math.inf:
            return f.read(), False
        want = int(limit)
        parts = [f.read(min(want, os.fstat(f.fileno()).st_size))]
        got = len(parts[0])
        while got < want and (part := f.read(min(want - got, _CHUNK))):
            parts.append(part)
            got += len(part)
        more = bool(f.read(1))
    return parts[0] if len(parts) == 1 else b"".join(parts), more


def read_corpus(path: str | Path | None = None, *, limit: int | None = None) -> torch.Tensor:
    """The bytes of ``path`` (a file, or the files under a folder in a fixed order) as a uint8 tensor.

    Without ``path``, the ``.py`` files of the standard library (not
    site-packages), in sorted order: text that needs no download and is the
    same on every run on one machine. At most ``limit`` bytes are read (by
    default all of ``path``, :data:`DEFAULT_LIMIT` of the standard library);
    a corpus cut short is logged as a warning.
    """
    root = Path(path) if path is not None else standard_library()
    bound: float = limit if limit is not None else DEFAULT_LIMIT if path is None else math.inf
    if not bound >= 1:
        raise ValueError(f"limit must be a number of bytes >= 1, got {limit}")
    cut = False
    chunks: list[bytes] = []
    size = 0
    for file in _files(root, None if path is not None else ".py"):
        try:
            data, more = _head(file, bound - size)
        except OSError as err:
            log.warning("skipping %s: %s", file, err)
            continue
        if data:
            chunks.append(data)
            size += len(data)
        if more:  # the limit is reached, and this file holds more text
            cut = True
            break
    if size < 2:
        raise ValueError(f"the corpus at {root} holds {size} bytes of text; pass a file or folder with text in it")
    data = b"".join(chunks)
    _check_text(data[:TEXT_CHECKED], root)
    log.info("read %d bytes from %d files under %s", size, len(chunks), root)
    if cut and path is not None:
        log.warning("read the first %d bytes of %s, its limit; give a larger one to read more", size, root)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


BINARY_SHARE = 0.1
"""The share of control bytes (not tab, newline, carriage return or form feed) past which a corpus is binary."""

TEXT_CHECKED = 64 * 1024
"""How much of the start of a corpus is checked for :data:`BINARY_SHARE`."""

_CONTROL = bytes(b for b in [*range(32), 127] if b not in b"\t\n\r\f")


def _check_text(head: bytes, root: Path) -> None:
    """Refuse a corpus whose start ``head`` is not text: more than :data:`BINARY_SHARE` of it control bytes (an
    executable, an archive, an image); bytes of UTF-8 text above 127 count as text."""
    control = len(head) - len(head.translate(None, _CONTROL))
    if control > BINARY_SHARE * len(head):
        raise ValueError(
            f"{root} does not look like text: {control / len(head):.0%} of its first {len(head)} bytes are control "
            "bytes (a program, an archive or an image?); give a text file or a folder of text files"
        )


def window_index(index: int, count: int, of: str = "") -> int:
    """``index`` of one of ``count`` windows, counted from the end when negative; an IndexError past them (what
    ends a plain for loop over a dataset of windows)."""
    if index < 0:
        index += count
    if not 0 <= index < count:
        raise IndexError(f"sample {index} of {of}{count} sequences")
    return index


class ByteText(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Consecutive windows of a byte string: sample ``i`` is ``seq_len`` bytes and the same bytes shifted by one.

    Inputs and targets are int64 token ids in 0..255 (a vocabulary of 256).
    """

    def __init__(self, data: torch.Tensor, seq_len: int) -> None:
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        if len(data) < seq_len + 1:
            raise ValueError(
                f"{len(data)} bytes of text are too few for one sequence of {seq_len} tokens; "
                "use more text or a shorter sequence"
            )
        self.data = data
        self.seq_len = seq_len

    def __len__(self) -> int:
        return (len(self.data) - 1) // self.seq_len

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = window_index(index, len(self), "a text of ") * self.seq_len
        window = self.data[start : start + self.seq_len + 1].long()
        return window[:-1], window[1:]


@dataclass(frozen=True)
class TextSplits:
    """A corpus cut into training and validation text."""

    train: ByteText
    val: ByteText


def text_splits(
    path: str | Path | None, seq_len: int, *, val_fraction: float = 0.05, limit: int | None = None
) -> TextSplits:
    """The corpus at ``path`` (see :func:`read_corpus`), its last ``val_fraction`` held out for validation."""
    if not 0 < val_fraction < 1:
        raise ValueError(f"val_fraction must be between 0 and 1, got {val_fraction}")
    data = read_corpus(path, limit=limit)
    cut = int(len(data) * (1 - val_fraction))
    if len(data) - cut < seq_len + 1:
        need = math.ceil((seq_len + 1) / val_fraction)
        raise ValueError(
            f"the validation split (the last {val_fraction:.0%} of the text, {len(data) - cut} bytes) is too short for "
            f"one sequence of {seq_len} tokens; use more text (about {need} bytes) or a shorter sequence"
        )
    return TextSplits(ByteText(data[:cut], seq_len), ByteText(data[cut:], seq_len))
