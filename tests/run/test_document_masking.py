"""Packed documents kept apart in a run: the windows say where documents start, and the pipeline trains on them."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch
from support.corpus import texts, write_json_lines
from support.training import BASE, launch_run

from stagewise.models.gpt import IGNORE_INDEX
from stagewise.run import TrainConfig
from stagewise.run.data import language_splits, needs_tokenizing, prepared
from stagewise.run.token_file import TokenFile, write_token_file
from stagewise.run.token_windows import TokenWindows
from stagewise.run.tokenizer import ByteTokenizer


def test_a_window_gives_each_tokens_place_in_its_document_and_no_target_across_an_end(tmp_path: Path) -> None:
    write_json_lines(tmp_path / "docs.jsonl", ["abcdef", "gh", "", "ijklmnopq"])
    write_token_file(tmp_path / "docs.jsonl", ByteTokenizer(), tmp_path / "tokens")
    file = TokenFile(tmp_path / "tokens")  # abcdef0 gh0 0 ijklmnopq0 (0: end of text)
    plain, packed = TokenWindows(file, 5), TokenWindows(file, 5, documents=True)
    assert len(packed) == len(plain) == 4
    (ids, positions), targets = packed[1]  # tokens 5 to 10: "f", eos, "g", "h", eos, and eos as the last target
    assert ids.tolist() == plain[1][0].tolist() == [ord("f"), 0, ord("g"), ord("h"), 0]
    assert positions.tolist() == [0, 1, 0, 1, 2]  # "f" opens the window: its document counts from there
    assert targets.tolist() == [0, IGNORE_INDEX, ord("h"), 0, IGNORE_INDEX]  # an end of text predicts nothing
    (ids, positions), targets = packed[2]  # the empty document: its end of text alone, then "ijkl"
    assert ids.tolist() == [0, ord("i"), ord("j"), ord("k"), ord("l")] and positions.tolist() == [0, 0, 1, 2, 3]
    assert targets.tolist() == [IGNORE_INDEX, ord("j"), ord("k"), ord("l"), ord("m")]
    assert ids.dtype == positions.dtype == targets.dtype == torch.int64


def test_document_masking_needs_documents_and_a_language_model() -> None:
    with pytest.raises(ValueError, match=r"^document_masking needs the data's documents, but the default data"):
        TrainConfig(document_masking=True)
    with pytest.raises(ValueError, match=r"^document_masking keeps a language model's documents apart, but mlp-tiny"):
        TrainConfig(model="mlp-tiny", document_masking=True, data="x")
    assert needs_tokenizing(TrainConfig(data=__file__, document_masking=True))  # bytes too, for their bounds
    assert not needs_tokenizing(TrainConfig(data=__file__))


@pytest.mark.timeout(300)
def test_a_gpt_trains_on_packed_documents_kept_apart(tmp_path: Path) -> None:
    lines = [line for text in texts(12) for line in text.splitlines() if line.strip()]  # a document a line
    corpus = write_json_lines(tmp_path / "docs.jsonl", lines)
    config = prepared(dataclasses.replace(BASE, data=str(corpus), document_masking=True), tmp_path / "tokens")
    train, _ = language_splits(config)
    windows = [train[i] for i in range(10)]
    starts = [int((positions == 0).sum()) for (_, positions), _ in windows]
    assert sum(starts) > 15 and sum(int((t == IGNORE_INDEX).sum()) for _, t in windows) == sum(starts) - 10
    masked = launch_run(config)
    plain = launch_run(dataclasses.replace(config, document_masking=False))
    assert len(masked) == len(plain) == BASE.steps and all(math.isfinite(x) for x in masked)
    assert masked[-1] < masked[0] - 0.5  # it learns
    assert masked != plain  # the same windows, kept apart: other losses
