"""A folder Hugging Face ``datasets`` saved (``save_to_disk``) as documents: one a row, memory-mapped, in order.

``Dataset.save_to_disk`` writes Arrow files beside ``dataset_info.json`` and
``state.json``; ``DatasetDict.save_to_disk`` writes a ``dataset_dict.json``
and one such folder a split. Such a folder is read with
``datasets.load_from_disk``, which maps its Arrow files rather than reading
them, and its rows are taken a batch at a time: nothing is read whole. A
DatasetDict is read through its ``train`` split; another split is read by
naming its own folder (``DIR/validation``), which is a saved Dataset itself.

The text is in a column, named as a Parquet file's is (``--data-column``,
:attr:`~stagewise.run.documents.Fields.column`), not a JSON line's field: a
saved dataset is an Arrow table, and ``datasets`` itself speaks of columns
(``column_names``, ``select_columns``). Rows whose text is missing (null) are
left out, as in Parquet. ``datasets`` is imported only here, when such a
folder is read (the ``datasets`` extra).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

DICT, INFO, STATE = "dataset_dict.json", "dataset_info.json", "state.json"
SPLIT = "train"
"""The split of a DatasetDict that is read."""
_BATCH = 256
"""Rows taken from the mapped Arrow files at a time."""
_TEXT = ("string", "large_string")


def is_saved_dataset(folder: Path) -> bool:
    """Whether ``folder`` is one that ``Dataset.save_to_disk`` or ``DatasetDict.save_to_disk`` wrote, by its files."""
    return (folder / DICT).is_file() or ((folder / INFO).is_file() and (folder / STATE).is_file())


def _load(folder: Path) -> Any:
    try:
        import datasets
    except ImportError as err:
        raise ImportError(
            f"{folder} is a saved Hugging Face dataset; reading it needs datasets: pip install 'stagewise[datasets]'"
        ) from err
    loaded = datasets.load_from_disk(str(folder), keep_in_memory=False)
    if isinstance(loaded, datasets.DatasetDict):
        if SPLIT not in loaded:
            splits = list(loaded)
            such = f" (such as {folder / splits[0]})" if splits else ""
            raise ValueError(
                f"{folder} is a DatasetDict with the splits {splits} and no {SPLIT!r}; give the folder of the "
                f"split to train on as --data{such}"
            )
        loaded = loaded[SPLIT]
    return loaded


def _checked(dataset: Any, folder: Path, column: str) -> None:
    """Refuse a ``column`` the dataset does not have, or one that holds no text, naming those it has."""
    import datasets

    texts = [
        name
        for name, feature in dataset.features.items()
        if isinstance(feature, datasets.Value) and feature.dtype in _TEXT
    ]
    if column not in dataset.column_names:
        raise ValueError(
            f"{folder} has no column {column!r} (it has {dataset.column_names}, text in {texts}); "
            "name it with --data-column"
        )
    if column not in texts:
        raise ValueError(
            f"{folder}: the column {column!r} holds {dataset.features[column]}, not text; name a column of "
            f"text with --data-column (it has {texts})"
        )


def saved_dataset_documents(folder: Path, column: str) -> Iterator[str]:
    """The text in ``column`` of each row of the dataset saved in ``folder`` (a DatasetDict's ``train``), in order."""
    dataset = _load(folder)
    _checked(dataset, folder, column)
    for batch in dataset.select_columns([column]).iter(batch_size=_BATCH):
        for text in batch[column]:
            if isinstance(text, str):
                yield text
