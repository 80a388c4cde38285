"""The MLP and CNN reference models, their synthetic data, and the byte-level text corpus."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from stagewise.models import PRESETS, CNNConfig, MLPConfig, build
from stagewise.models.synthetic import pattern_images, teacher_regression
from stagewise.models.text import ByteText, read_corpus, text_splits
from stagewise.partition import layers_of
from stagewise.pipeline import materialise_model


@pytest.mark.parametrize("name", ["mlp-tiny", "cnn-tiny"])
def test_presets_are_chains_that_materialise_layer_by_layer(name: str) -> None:
    config = PRESETS[name]
    meta = build(name, device="meta")
    assert all(p.is_meta for p in meta.parameters())
    model = materialise_model(meta, seed=3)
    x = config.example(4)
    direct = model(x)
    chained = x
    for layer in layers_of(model):
        chained = layer.module(chained)
    torch.testing.assert_close(chained, direct)  # running the layers one by one is the model
    again = materialise_model(build(name, device="meta"), seed=3)
    for a, b in zip(model.parameters(), again.parameters(), strict=True):
        assert torch.equal(a, b)  # initialisation depends on the seed alone


def test_shapes_and_losses() -> None:
    mlp = MLPConfig(d_in=5, d_model=16, n_layers=2, d_out=3)
    assert mlp.build()(torch.zeros(7, 5)).shape == (7, 3)
    cnn = CNNConfig(in_channels=1, image_size=8, widths=(4, 8), blocks_per_width=1, n_classes=6)
    logits = cnn.build()(torch.zeros(2, 1, 8, 8))
    assert logits.shape == (2, 6)
    assert float(cnn.loss(logits, torch.tensor([0, 1])).detach()) > 0
    with pytest.raises(ValueError, match=r"image_size=2 is too small to halve 2 times"):
        CNNConfig(image_size=2, widths=(4, 8, 16))
    with pytest.raises(ValueError, match=r"MLPConfig.n_layers must be >= 1, got 0"):
        MLPConfig(n_layers=0)


def test_synthetic_sets_share_their_teacher_and_patterns() -> None:
    config = MLPConfig(d_in=4, d_out=2)
    train, val = teacher_regression(config, 64, seed=1), teacher_regression(config, 64, seed=2)
    assert not torch.equal(train.tensors[0], val.tensors[0])  # the seed draws the inputs
    other = teacher_regression(config, 64, seed=1, teacher=5)
    assert torch.equal(other.tensors[0], train.tensors[0]) and not torch.equal(other.tensors[1], train.tensors[1])
    cnn = CNNConfig(image_size=8, widths=(4,))
    images, again = pattern_images(cnn, 64, seed=1, noise=0.0), pattern_images(cnn, 64, seed=2, noise=0.0)
    shared = set(images.tensors[1].tolist()) & set(again.tensors[1].tolist())
    assert shared
    for label in shared:
        a = images.tensors[0][images.tensors[1] == label][0]
        b = again.tensors[0][again.tensors[1] == label][0]
        torch.testing.assert_close(a, b)  # a class looks the same in both sets


def test_text_windows_and_splits(tmp_path: Path) -> None:
    (tmp_path / "b.txt").write_bytes(b"0123456789")
    (tmp_path / "a.txt").write_bytes(b"abcdefghij")
    data = read_corpus(tmp_path)
    assert bytes(data.tolist()) == b"abcdefghij0123456789"  # files in sorted order
    windows = ByteText(data, 4)
    assert len(windows) == 4
    x, y = windows[1]
    assert bytes(x.tolist()) == b"efgh" and bytes(y.tolist()) == b"fghi" and x.dtype == torch.int64
    splits = text_splits(tmp_path / "a.txt", 2, val_fraction=0.4)
    assert len(splits.train) == 2 and len(splits.val) == 1
    assert read_corpus(limit=1000).numel() == 1000  # the standard library's source, by default
    with pytest.raises(FileNotFoundError, match=r"no text file or folder at .*missing; pass an existing --data"):
        read_corpus(tmp_path / "missing")
    with pytest.raises(ValueError, match=r"10 bytes of text are too few for one sequence of 20 tokens"):
        ByteText(read_corpus(tmp_path / "a.txt"), 20)
    # Indexed as a sequence: from the end too, and a plain loop stops at its length.
    assert bytes(windows[-1][0].tolist()) == bytes(windows[3][0].tolist()) == b"2345"
    assert len(list(windows)) == 4
    with pytest.raises(IndexError, match=r"sample 4 of a text of 4 sequences"):
        windows[4]
    # The held-out text, not the whole, is what is too short.
    (tmp_path / "short.txt").write_bytes(bytes(range(97, 123)) * 40)  # 1040 bytes: 52 held out
    with pytest.raises(ValueError, match=r"the validation split \(the last 5% of the text, 52 bytes\) is too short"):
        text_splits(tmp_path / "short.txt", 128)


def test_cnn_widths_that_group_norm_cannot_split_are_refused() -> None:
    assert CNNConfig(widths=(4, 8, 16)).build(device="meta") is not None
    with pytest.raises(ValueError, match=r"CNNConfig.widths must be at most 8 or multiples of 8 \(group norm\), got "):
        CNNConfig(widths=(12, 24))


def test_a_corpus_given_is_read_whole_and_a_limit_says_so(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # Every corpus was cut to its first 8 MiB without a word, and its validation split taken from that part.
    corpus = tmp_path / "big.txt"
    corpus.write_bytes(bytes(range(32, 128)) * ((9 << 20) // 96))  # 9 MiB of printable text
    assert read_corpus(corpus).numel() == 9 << 20
    splits = text_splits(corpus, 64)
    assert splits.val.data.numel() == (9 << 20) - int((9 << 20) * 0.95)  # the held-out end of the whole text
    with caplog.at_level("WARNING", logger="stagewise.models.text"):
        assert read_corpus(corpus, limit=1 << 20).numel() == 1 << 20
    assert f"read the first 1048576 bytes of {corpus}, its limit; give a larger one to read more" in caplog.text
    assert read_corpus().numel() == 8 << 20  # the standard library's source stays capped: no warning
    with pytest.raises(ValueError, match=r"limit must be a number of bytes >= 1, got 0"):
        read_corpus(corpus, limit=0)


def test_a_binary_file_is_refused_as_data(tmp_path: Path) -> None:
    # A program given as --data was trained on, byte by byte, without a word.
    program = tmp_path / "program"
    program.write_bytes(bytes(range(256)) * 64 + b"\0" * 4096)
    with pytest.raises(ValueError, match=r"program does not look like text: 29% of its first 20480 bytes are control"):
        read_corpus(program)
    assert read_corpus(Path(__file__)).numel() > 0  # this file is text


class _CountingFile:
    """A file opened for reading whose reads add up, in ``read``, the bytes they returned."""

    def __init__(self, file: Any, read: list[int]) -> None:
        self.file, self.counts = file, read

    def __enter__(self) -> _CountingFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.file.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.file, name)

    def read(self, n: int = -1) -> bytes:
        data: bytes = self.file.read(n)
        self.counts.append(len(data))
        return data


def test_a_limited_corpus_reads_no_more_of_its_files_than_the_limit(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The whole corpus was read and then cut: 1 KiB of a 100 GB file read all 100 GB first.
    (tmp_path / "a.txt").write_bytes(b"a" * 3000)
    (tmp_path / "b.txt").write_bytes(b"b" * 5000)
    read: list[int] = []
    opened = Path.open
    monkeypatch.setattr(Path, "open", lambda self, *a, **k: _CountingFile(opened(self, *a, **k), read))
    with caplog.at_level("WARNING", logger="stagewise.models.text"):
        assert read_corpus(tmp_path / "a.txt", limit=1024).tolist() == [ord("a")] * 1024
        assert sum(read) == 1025  # the limit, and one byte to know there was more
        assert f"read the first 1024 bytes of {tmp_path / 'a.txt'}, its limit" in caplog.text
        read.clear()
        assert bytes(read_corpus(tmp_path, limit=4000).tolist()) == b"a" * 3000 + b"b" * 1000
        assert sum(read) == 4001 and f"read the first 4000 bytes of {tmp_path}, its limit" in caplog.text
        caplog.clear()
        read.clear()
        assert read_corpus(tmp_path, limit=3000).numel() == 3000  # then only one byte of the next file
        assert sum(read) == 3001 and "read the first 3000 bytes" in caplog.text
        caplog.clear()
        assert read_corpus(tmp_path, limit=8000).numel() == 8000  # all of it: nothing cut, nothing to say
        assert read_corpus(tmp_path / "a.txt", limit=3000).numel() == 3000
    assert caplog.text == ""
