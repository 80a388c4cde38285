"""A corpus as documents, read one at a time: text files or folders, JSON lines (a field), Parquet (a column).

A text file is one document; a ``.jsonl`` file holds one per line, in the
field ``field``; a ``.parquet`` file one per row, in the column ``column``
(read a row group at a time, with pyarrow). A folder is read file by file in
sorted order, its ``.jsonl`` and ``.parquet`` files as such, the rest as text.
Nothing is read whole into memory.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

_SKIP = frozenset({"__pycache__", ".git"})


@dataclass(frozen=True)
class Fields:
    """Where a structured file holds its text."""

    field: str = "text"
    """The JSON lines' field."""
    column: str = "text"
    """The Parquet files' column."""


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


def documents(root: str | Path, fields: Fields = Fields()) -> Iterator[str]:
    """Every document of the corpus at ``root``, in order."""
    for path in files(Path(root)):
        if path.suffix == ".jsonl":
            yield from _json_lines(path, fields.field)
        elif path.suffix == ".parquet":
            yield from _parquet(path, fields.column)
        else:
            yield path.read_text(encoding="utf-8", errors="replace")
