"""Token files: a corpus tokenized once into ids that a run reads a window at a time, with its documents' bounds.

A token file is a folder: ``tokens.bin`` holds every document's ids followed
by the tokenizer's end-of-text token, as uint16 where the vocabulary fits and
uint32 otherwise; ``documents.bin`` the offset of each document's first token
and, last, the number of tokens (uint64); ``meta.json`` the dtype, the counts,
the vocabulary size, the end-of-text token and the tokenizer. It is written
into ``NAME.partial`` and renamed when complete, and read a window at a time.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import shutil
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from stagewise.run.documents import Fields, documents
from stagewise.run.tokenizer import Tokenizer, load_tokenizer

META, TOKENS, INDEX = "meta.json", "tokens.bin", "documents.bin"
FORMAT = 1


@dataclass(frozen=True)
class TokenFileMeta:
    """What ``meta.json`` records."""

    dtype: str
    """``uint16`` or ``uint32``."""
    tokens: int
    documents: int
    vocab_size: int
    eos_id: int
    tokenizer: str
    """``bytes`` or the tokenizer's folder."""
    format: int = FORMAT


def dtype_for(vocab_size: int) -> np.dtype[np.unsignedinteger]:
    """The narrowest dtype that holds every id of a vocabulary of ``vocab_size``."""
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


def is_token_file(path: str | Path) -> bool:
    return (Path(path) / META).is_file()


class TokenFile:
    """A token file, read where asked: :meth:`read` a run of tokens, :meth:`document` one document.

    Tokens are read with ``pread``, not mapped: training reads short windows at
    random, and each fault in a mapping brings the kernel's whole page-cache
    folio around it into the process's resident memory (2 MiB a window here: 1.1
    GiB after 50 steps on a 2 GiB file). The document bounds are mapped.
    """

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        try:
            raw = json.loads((self.folder / META).read_text())
            self.meta = TokenFileMeta(**raw)
        except (OSError, ValueError, TypeError) as err:
            raise ValueError(f"{self.folder} is not a token file ({type(err).__name__}: {err})") from err
        if self.meta.format != FORMAT or self.meta.dtype not in ("uint16", "uint32"):
            raise ValueError(f"{self.folder}: token file format {self.meta.format} / {self.meta.dtype} is not known")
        self.dtype = np.dtype(self.meta.dtype)
        self._fd = os.open(self.folder / TOKENS, os.O_RDONLY)
        held = os.fstat(self._fd).st_size // self.dtype.itemsize
        self.starts: np.ndarray = np.memmap(self.folder / INDEX, dtype=np.uint64, mode="r")
        if held != self.meta.tokens or len(self.starts) != self.meta.documents + 1:
            os.close(self._fd)
            raise ValueError(
                f"{self.folder} holds {held} tokens and {len(self.starts) - 1} documents, but its "
                f"meta.json says {self.meta.tokens} and {self.meta.documents}: it is truncated; tokenize again"
            )

    def __len__(self) -> int:
        """Tokens in the file."""
        return self.meta.tokens

    def read(self, start: int, count: int) -> np.ndarray:
        """Tokens ``start`` to ``start + count`` (fewer at the end of the file)."""
        size = self.dtype.itemsize
        return np.frombuffer(os.pread(self._fd, count * size, start * size), dtype=self.dtype)

    def document(self, index: int) -> np.ndarray:
        """The ids of document ``index``, its end-of-text token included."""
        start, stop = int(self.starts[index]), int(self.starts[index + 1])
        return self.read(start, stop - start)

    def __getstate__(self) -> dict[str, Any]:  # a data-loading worker opens the file for itself
        return {"folder": self.folder}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["folder"])  # type: ignore[misc]

    def __del__(self) -> None:
        with contextlib.suppress(AttributeError, OSError):
            os.close(self._fd)


_WORKER: list[Tokenizer] = []


def _start_worker(name: str) -> None:
    _WORKER[:] = [load_tokenizer(name)]


def _encode(text: str) -> tuple[list[int], int]:
    return _WORKER[0].encode(text), len(text.encode("utf-8", errors="replace"))


def _encoded(texts: Iterable[str], tokenizer: Tokenizer, workers: int) -> Iterator[tuple[list[int], int]]:
    """Each text's ids and its size in bytes, in order: in ``workers`` processes, each with the tokenizer."""
    if workers <= 1:
        for text in texts:
            yield tokenizer.encode(text), len(text.encode("utf-8", errors="replace"))
        return
    context = multiprocessing.get_context("spawn")  # the parent may hold threads a fork would copy half-way
    with context.Pool(workers, initializer=_start_worker, initargs=(tokenizer.name,)) as pool:
        yield from pool.imap(_encode, texts, chunksize=16)


def write_token_file(
    corpus: str | Path,
    tokenizer: Tokenizer,
    out: str | Path,
    *,
    fields: Fields = Fields(),
    workers: int = 1,
    progress: Callable[[int], object] | None = None,
) -> TokenFileMeta:
    """Tokenize every document of ``corpus`` (see :func:`~stagewise.run.documents.documents`) into the token file
    ``out``, in ``workers`` processes; ``progress(n)`` is told the bytes of text each document had."""
    target = Path(out)
    partial = target.with_name(target.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    dtype = dtype_for(tokenizer.vocab_size)
    total, count = 0, 0
    with (partial / TOKENS).open("wb") as tokens, (partial / INDEX).open("wb") as index:
        for ids, size in _encoded(documents(corpus, fields), tokenizer, workers):
            index.write(np.asarray([total], dtype=np.uint64).tobytes())
            ids.append(tokenizer.eos_id)
            tokens.write(np.asarray(ids, dtype=dtype).tobytes())
            total, count = total + len(ids), count + 1
            if progress is not None:
                progress(size)
        index.write(np.asarray([total], dtype=np.uint64).tobytes())
        for file in (tokens, index):
            file.flush()
            os.fsync(file.fileno())
    meta = TokenFileMeta(dtype.name, total, count, tokenizer.vocab_size, tokenizer.eos_id, tokenizer.name)
    (partial / META).write_text(json.dumps(asdict(meta), indent=1) + "\n")
    if target.exists():
        shutil.rmtree(target)
    os.replace(partial, target)
    return meta
