"""Folders Hugging Face ``datasets`` saved as a run's data: their rows as documents, a DatasetDict's train split,
the column checked, and the same token file as the same texts given as JSON lines."""

from __future__ import annotations

import sys
from pathlib import Path

import datasets
import numpy as np
import pytest
from support.corpus import write_json_lines

from stagewise.cli import main
from stagewise.run import TrainConfig
from stagewise.run.data import needs_tokenizing, prepared
from stagewise.run.documents import Fields, documents, sources
from stagewise.run.token_file import TokenFile

ROWS = ["first row", "second, with ünïcode", "", "third\nline", "x" * 3000]


def _saved(folder: Path, texts: list[str | None], column: str = "text") -> Path:
    rows = {column: texts, "n": list(range(len(texts)))}
    datasets.Dataset.from_dict(rows).save_to_disk(str(folder))
    return folder


def test_a_saved_dataset_is_its_rows_in_order_also_inside_a_folder(tmp_path: Path) -> None:
    saved = _saved(tmp_path / "corpus" / "b-saved", [*ROWS[:2], None, *ROWS[2:]])  # a null row is left out
    assert list(documents(saved)) == ROWS
    (tmp_path / "corpus" / "a.txt").write_text("a file before it")
    (tmp_path / "corpus" / "c.txt").write_text("a file after it")
    assert sources(tmp_path / "corpus") == [tmp_path / "corpus" / "a.txt", saved, tmp_path / "corpus" / "c.txt"]
    assert list(documents(tmp_path / "corpus")) == ["a file before it", *ROWS, "a file after it"]
    renamed = _saved(tmp_path / "body", ROWS, column="body")
    assert list(documents(renamed, Fields(column="body"))) == ROWS


def test_a_dataset_dict_is_read_through_its_train_split(tmp_path: Path) -> None:
    splits = {"test": ["held out"], "train": ROWS}
    datasets.DatasetDict({k: datasets.Dataset.from_dict({"text": v}) for k, v in splits.items()}).save_to_disk(
        str(tmp_path / "dict")
    )
    assert list(documents(tmp_path / "dict")) == ROWS
    datasets.DatasetDict({"validation": datasets.Dataset.from_dict({"text": ROWS[:2]})}).save_to_disk(
        str(tmp_path / "no-train")
    )
    with pytest.raises(ValueError, match=r"^[^\n]*\['validation'\] and no 'train'; give the folder of the split") as e:
        list(documents(tmp_path / "no-train"))
    assert str(tmp_path / "no-train" / "validation") in str(e.value)
    assert list(documents(tmp_path / "no-train" / "validation")) == ROWS[:2]  # the way out the error names


def test_a_column_the_dataset_lacks_or_that_holds_no_text_is_refused_in_one_line(tmp_path: Path) -> None:
    saved = _saved(tmp_path / "saved", ROWS)
    with pytest.raises(ValueError, match=r"^[^\n]*has no column 'body' \(it has \['text', 'n'\], text in \['text'\]\)"):
        list(documents(saved, Fields(column="body")))
    with pytest.raises(ValueError, match=r"^[^\n]*the column 'n' holds Value\('int64'\), not text; .* \['text'\]\)$"):
        list(documents(saved, Fields(column="n")))


def test_without_datasets_the_error_names_the_extra(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    saved = _saved(tmp_path / "saved", ROWS)
    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets raises ImportError
    with pytest.raises(ImportError, match=r"saved Hugging Face dataset; .*pip install 'stagewise\[datasets\]'$"):
        list(documents(saved))


def test_a_saved_dataset_tokenizes_as_the_same_texts_in_json_lines_and_again_when_it_changes(tmp_path: Path) -> None:
    saved = _saved(tmp_path / "saved", ROWS)
    lines = write_json_lines(tmp_path / "rows.jsonl", ROWS)
    config = TrainConfig(model="gpt-tiny", data=str(saved))
    assert needs_tokenizing(config)  # bytes, but not the bytes of its Arrow files
    ready = TokenFile(prepared(config, tmp_path / "cache").data or "")
    same = TokenFile(prepared(TrainConfig(model="gpt-tiny", data=str(lines)), tmp_path / "cache").data or "")
    assert ready.meta == same.meta and ready.meta.documents == len(ROWS)
    assert np.array_equal(ready.read(0, len(ready)), same.read(0, len(same)))
    assert np.array_equal(ready.starts, same.starts)
    assert main(["tokenize", "--data", str(saved), "--out", str(tmp_path / "cli"), "--workers", "1"]) == 0
    cli = TokenFile(tmp_path / "cli")
    assert cli.meta == same.meta and np.array_equal(cli.read(0, len(cli)), same.read(0, len(same)))

    _saved(saved, ["another corpus"])  # saved again in the same folder: the corpus's key changes
    changed = TokenFile(prepared(config, tmp_path / "cache").data or "")
    assert changed.folder != ready.folder and bytes(changed.document(0)[:-1].tolist()) == b"another corpus"
