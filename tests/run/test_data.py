"""A run's data: documents from text, JSON lines, Parquet and CSV, token files written in order and mapped from disk,
windows of packed documents, and tokenizers checked against the model before anything starts."""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from support.corpus import bpe_folder, texts, write_json_lines

from stagewise.cli import main
from stagewise.run import TrainConfig
from stagewise.run.data import language_splits, needs_tokenizing, prepared, tokenizer_of
from stagewise.run.documents import Fields, documents
from stagewise.run.token_file import TokenFile, dtype_for, write_token_file
from stagewise.run.token_windows import TokenWindows, token_splits
from stagewise.run.tokenizer import ByteTokenizer, HFTokenizer

DOCUMENTS = ["first document", "second, with ünïcode", "", "third\nline"]


def test_documents_come_from_text_json_lines_and_parquet_in_order(tmp_path: Path) -> None:
    folder = tmp_path / "corpus"
    folder.mkdir()
    write_json_lines(folder / "a.jsonl", DOCUMENTS[:2], field="body")
    pq.write_table(pa.table({"content": DOCUMENTS[2:]}), folder / "b.parquet", row_group_size=1)
    (folder / "c.txt").write_text("a file is one document")
    (folder / ".hidden").write_text("left out")
    got = list(documents(folder, Fields(field="body", column="content")))
    assert got == [*DOCUMENTS, "a file is one document"]
    with pytest.raises(ValueError, match=r"a.jsonl, line 1: no text field 'text' \(it has \['body', 'source'\]\)"):
        list(documents(folder))


def test_a_csv_file_is_a_document_a_row_in_its_column_named_in_its_header(tmp_path: Path) -> None:
    rows = [*DOCUMENTS, 'a "quoted", comma', "y" * 200_000]  # longer than the csv module's default field limit
    with (tmp_path / "rows.csv").open("w", encoding="utf-8-sig", newline="") as out:  # a byte-order mark first
        writer = csv.writer(out)
        writer.writerow(["id", "body"])
        writer.writerows([i, text] for i, text in enumerate(rows))
    assert list(documents(tmp_path / "rows.csv", Fields(column="body"))) == rows
    assert list(documents(tmp_path, Fields(column="body"))) == rows and needs_tokenizing(
        TrainConfig(model="gpt-tiny", data=str(tmp_path))
    )  # read as rows, not taken as bytes
    with pytest.raises(ValueError, match=r"rows.csv has no column 'text' \(its header has \['id', 'body'\]\); name"):
        list(documents(tmp_path / "rows.csv"))


def test_a_token_file_holds_each_document_and_its_end_of_text_and_is_mapped(tmp_path: Path) -> None:
    corpus = write_json_lines(tmp_path / "docs.jsonl", DOCUMENTS)
    meta = write_token_file(corpus, ByteTokenizer(), tmp_path / "tokens")
    file = TokenFile(tmp_path / "tokens")
    assert (meta.dtype, meta.documents, meta.eos_id, meta.vocab_size) == ("uint16", 4, 0, 256)
    assert file.meta == meta and len(file) == meta.tokens
    for index, text in enumerate(DOCUMENTS):
        ids = file.document(index)
        assert bytes(ids[:-1].tolist()).decode() == text and ids[-1] == 0
    assert meta.tokens == sum(len(t.encode()) + 1 for t in DOCUMENTS)
    assert not (tmp_path / "tokens.partial").exists()
    assert dtype_for(50304) == np.uint16 and dtype_for(65537) == np.uint32  # by the vocabulary's size
    windows = TokenWindows(file, 8)
    inputs, targets = windows[1]
    assert inputs.dtype == torch.int64 and torch.equal(inputs[1:], targets[:-1])
    assert inputs.tolist() == file.read(8, 8).tolist() and len(windows) == (meta.tokens - 1) // 8
    later = TokenWindows(file, 8, first=3, count=20)
    assert len(later) == 2 and later[1][0].tolist() == file.read(11, 8).tolist()
    (tmp_path / "tokens" / "tokens.bin").write_bytes(b"\0\0")
    with pytest.raises(ValueError, match=r"holds 1 tokens and 4 documents, but its meta.json says 50 and 4"):
        TokenFile(tmp_path / "tokens")


def test_parallel_tokenizing_writes_what_one_process_writes(tmp_path: Path) -> None:
    corpus = write_json_lines(tmp_path / "docs.jsonl", texts(12))
    tokenizer = HFTokenizer(bpe_folder(tmp_path / "bpe", texts(12), 1000))
    write_token_file(corpus, tokenizer, tmp_path / "one")
    out = subprocess.run(
        [sys.executable, "-m", "stagewise", "tokenize", "--data", str(corpus), "--tokenizer", str(tmp_path / "bpe"),
         "--out", str(tmp_path / "four"), "--workers", "3"],
        capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    assert "documents, vocabulary 1000, end-of-text 0" in out.stdout
    one, four = TokenFile(tmp_path / "one"), TokenFile(tmp_path / "four")
    assert one.meta == four.meta and one.meta.documents == 12
    assert np.array_equal(one.read(0, len(one)), four.read(0, len(four))) and np.array_equal(one.starts, four.starts)
    assert tokenizer.decode(one.document(3)[:-1].tolist()) == texts(12)[3]


def test_a_tokenizer_the_model_cannot_embed_is_refused_before_anything_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    documents_ = texts(6)
    corpus = write_json_lines(tmp_path / "docs.jsonl", documents_)
    small = bpe_folder(tmp_path / "small", documents_, 1000, model_vocab=600)  # its own tokenizer: 1000 tokens
    assert main(["train", "--model", f"hf:{small}", "--data", str(corpus), "--steps", "2"]) == 2
    err = capsys.readouterr().err
    assert f"the tokenizer {small} has 1000 tokens, more than the 600 that hf:{small} embeds" in err
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_text((small / "config.json").read_text())  # a model folder with no tokenizer
    assert main(["train", "--model", f"hf:{bare}", "--data", str(corpus), "--steps", "2"]) == 2
    assert "holds no tokenizer (no tokenizer.json), so its token ids are unknown" in capsys.readouterr().err
    with pytest.raises(ValueError, match=rf"the tokenizer {small} has 1000 tokens, more than the 256 that gpt-tiny"):
        prepared(TrainConfig(model="gpt-tiny", tokenizer=str(small), data=str(corpus)), tmp_path)


def test_data_that_needs_tokenizing_is_tokenized_once_and_split(tmp_path: Path) -> None:
    documents_ = texts(6)
    corpus = write_json_lines(tmp_path / "docs.jsonl", documents_)
    folder = bpe_folder(tmp_path / "model", documents_, 1000)
    config = TrainConfig(model=f"hf:{folder}", data=str(corpus), seq_len=32, batch_size=4)
    assert tokenizer_of(config) == str(folder)
    with pytest.raises(ValueError, match=r"must be tokenized first \(tokenizer .*\): run python -m stagewise tokenize"):
        language_splits(config)  # a rank under torchrun: nothing tokenizes there
    ready = prepared(config, tmp_path / "cache")
    again = prepared(config, tmp_path / "cache")
    assert ready.data == again.data and Path(ready.data or "").parent == tmp_path / "cache"
    train, val = language_splits(ready)
    splits = token_splits(ready.data or "", 32)
    total = TokenFile(ready.data or "").meta.tokens
    assert len(train) == len(splits.train) == (math.floor(total * 0.95) - 1) // 32
    assert len(val) > 0 and isinstance(train, TokenWindows)
    assert json.loads((Path(ready.data or "") / "meta.json").read_text())["tokenizer"] == str(folder)
    assert dataclasses.replace(ready, data=str(corpus), tokenizer=None) == config
