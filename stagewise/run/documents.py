"""A corpus as documents, read one at a time: text files or folders, JSON lines (a field), Parquet and CSV (a
column), and folders Hugging Face ``datasets`` saved (a column).

A text file is one document; a ``.jsonl`` file holds one per line, in the
field ``field``; a ``.parquet`` file one per row, in the column ``column``
(read a row group at a time, with pyarrow), and so does a ``.csv`` file (its
first line names the columns). A folder that ``save_to_disk`` wrote holds one
per row too, in the column ``column`` (see :mod:`stagewise.run.hf_datasets`),
whether it is ``--data`` itself or inside it. A folder is read file by file
in sorted order, its ``.jsonl``, ``.parquet`` and ``.csv`` files and saved
datasets as such, the rest as text. Nothing is read whole into memory.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from stagewise.run.hf_datasets import is_saved_dataset, saved_dataset_documents

_SKIP = frozenset({"__pycache__", ".git"})
_STRUCTURED = (".jsonl", ".parquet", ".csv")
_FIELD_LIMIT = (1 << 31) - 1
"""Characters a CSV field may hold: a document may be longer than the csv module's default of 128 KiB."""


@dataclass(frozen=True)
class Fields:
    """Where a structured file holds its text."""

    field: str = "text"
    """The JSON lines' field."""
    column: str = "text"
    """The column of Parquet and CSV files and of saved datasets."""


def files(root: Path) -> list[Path]:
    """The files of ``root`` (itself, if a file), in sorted order, hidden ones and caches left out."""
    if root.is_file():
        return [root]
    if not root.is_dir():
        raise ValueError(f"no text file or folder at {root}; pass an existing --data path")
    found = [
        p
        for p in sorted(root.rglob("*"))
        if p.is_file() and not any(part in _SKIP or part.startswith(".") for part in p.relative_to(root).parts)
    ]
    if not found:
        raise ValueError(f"--data {root}: the folder holds no files")
    return found


def _json_lines(path: Path, field: str) -> Iterator[str]:
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError as err:
                raise ValueError(
                    f"{path}, line {number}: not JSON ({err}); a .jsonl file holds one object a line"
                ) from err
            text = record.get(field) if isinstance(record, dict) else None
            if not isinstance(text, str):
                keys = sorted(record) if isinstance(record, dict) else type(record).__name__
                raise ValueError(
                    f"{path}, line {number}: no text field {field!r} (it has {keys}); name the field with --data-field"
                )
            yield text


def _parquet(path: Path, column: str) -> Iterator[str]:
    try:
        import pyarrow.parquet as pq
    except ImportError as err:
        raise ImportError(f"reading {path} needs pyarrow: pip install 'stagewise[data]'") from err
    table = pq.ParquetFile(path)
    if column not in table.schema_arrow.names:
        raise ValueError(
            f"{path} has no column {column!r} (it has {table.schema_arrow.names}); name it with --data-column"
        )
    for group in range(table.num_row_groups):
        for text in table.read_row_group(group, columns=[column]).column(column).to_pylist():
            if isinstance(text, str):
                yield text


def _csv(path: Path, column: str) -> Iterator[str]:
    csv.field_size_limit(max(csv.field_size_limit(), _FIELD_LIMIT))  # the module's own limit, only ever raised
    with path.open(encoding="utf-8-sig", newline="") as lines:  # -sig: a byte-order mark is not in the header
        rows = csv.reader(lines)
        header = next(rows, None)
        if header is None:
            return
        if column not in header:
            raise ValueError(f"{path} has no column {column!r} (its header has {header}); name it with --data-column")
        index = header.index(column)
        for row in rows:
            if index < len(row):
                yield row[index]


def sources(root: Path) -> list[Path]:
    """What :func:`documents` reads from ``root``, in order: its files, and each saved dataset under it (or
    ``root`` itself) as one folder in place of its files."""
    if is_saved_dataset(root):
        return [root]
    found = files(root)
    saved = {folder for folder in {p.parent for p in found} if is_saved_dataset(folder)}
    read: list[Path] = []
    saved_read: set[Path] = set()
    for path in found:
        dataset = next((folder for folder in reversed(path.parents) if folder in saved), None)  # outermost first
        if dataset is None:
            read.append(path)
        elif dataset not in saved_read:
            saved_read.add(dataset)
            read.append(dataset)
    return read


def structured(root: str | Path) -> bool:
    """Whether the corpus at ``root`` holds more than plain text (JSON lines, Parquet, CSV, a saved dataset), so
    its documents must be read out of it rather than its bytes taken as they are."""
    return any(p.is_dir() or p.suffix in _STRUCTURED for p in sources(Path(root)))


def documents(root: str | Path, fields: Fields = Fields()) -> Iterator[str]:
    """Every document of the corpus at ``root``, in order."""
    for path in sources(Path(root)):
        if path.is_dir():
            yield from saved_dataset_documents(path, fields.column)
        elif path.suffix == ".jsonl":
            yield from _json_lines(path, fields.field)
        elif path.suffix == ".parquet":
            yield from _parquet(path, fields.column)
        elif path.suffix == ".csv":
            yield from _csv(path, fields.column)
        else:
            yield path.read_text(encoding="utf-8", errors="replace")
