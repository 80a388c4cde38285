"""A language model's data for a run: which tokenizer reads it, tokenized once into a token file where needed.

Text files and folders read with the byte tokenizer (the presets' default)
are read as bytes, as they are. Anything else is tokenized once, before the
ranks start, into a token file that every rank reads a window at a time (kept under
``stagewise-run/tokens/``, one per corpus, tokenizer and fields):
JSON lines, Parquet and CSV files, folders Hugging Face ``datasets`` saved,
and any text read with a Hugging Face tokenizer. A token file given as
``--data`` is used as it is. An ``hf:DIR`` model reads its data with the
folder's own tokenizer; ``--tokenizer`` names another (or ``bytes``). A
tokenizer with more tokens than the model embeds is refused.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch.utils.data import Dataset

from stagewise.models import GPTConfig
from stagewise.models.text import text_splits
from stagewise.run.config import TrainConfig
from stagewise.run.documents import Fields, files, structured
from stagewise.run.token_file import TokenFile, is_token_file, write_token_file
from stagewise.run.token_windows import token_splits
from stagewise.run.tokenizer import BYTES, check_fits, has_tokenizer, load_tokenizer
from stagewise.run.user_model import UserModel, model_of


def tokenizer_of(config: TrainConfig) -> str:
    """The tokenizer ``config``'s data is read with: ``--tokenizer``, else an ``hf:DIR`` model's own, else bytes.
    An ``hf:DIR`` folder without a tokenizer needs one named (``bytes`` too): its vocabulary is not bytes."""
    if config.tokenizer is not None:
        return config.tokenizer
    model = model_of(config.model)
    folder = model.folder if isinstance(model, UserModel) else None
    if folder is None:
        return BYTES
    if not has_tokenizer(folder):
        raise ValueError(
            f"{config.model} holds no tokenizer (no tokenizer.json), so its token ids are unknown; give its "
            "tokenizer's folder with --tokenizer DIR, or --tokenizer bytes to train it on bytes"
        )
    return str(folder)


def model_vocab(config: TrainConfig) -> int | None:
    """The number of tokens ``config``'s model embeds, where it says."""
    model = model_of(config.model)
    if isinstance(model, GPTConfig):
        return model.vocab_size
    return model.vocab_size if isinstance(model, UserModel) else None


def needs_tokenizing(config: TrainConfig) -> bool:
    """Whether ``config``'s data must become a token file before the ranks start."""
    if config.data is not None and is_token_file(config.data):
        return False
    if tokenizer_of(config) != BYTES or config.document_masking:  # a token file knows its documents' bounds
        return True
    return config.data is not None and structured(config.data)


def _key(config: TrainConfig, tokenizer: str) -> str:
    """What names a corpus tokenized one way: its files (paths, sizes, times; a saved dataset's Arrow files and
    state among them), the tokenizer and the fields."""
    assert config.data is not None
    listed = [(str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns) for p in files(Path(config.data))]
    what = [
        listed,
        str(Path(tokenizer).resolve()) if tokenizer != BYTES else BYTES,
        config.data_field,
        config.data_column,
    ]
    return hashlib.sha256(json.dumps(what).encode()).hexdigest()[:16]


def prepared(config: TrainConfig, cache: Path, progress: Callable[[int], object] | None = None) -> TrainConfig:
    """``config`` with its data as the ranks will read it: tokenized into a token file under ``cache`` when it
    must be (see the module's description; once for each corpus, tokenizer and fields: a resumed run maps the
    same file), its tokenizer checked against the model first."""
    if not isinstance(model_of(config.model), (GPTConfig, UserModel)):
        return config
    name = tokenizer_of(config)
    tokenizer = load_tokenizer(name)
    check_fits(tokenizer.vocab_size, model_vocab(config), name, config.model)
    if not needs_tokenizing(config):
        return config
    if config.data is None:
        raise ValueError(
            f"--tokenizer {name} reads the data with it, but no --data was given; name the text to train on"
        )
    out = cache / _key(config, name)
    if not is_token_file(out):
        fields = Fields(config.data_field, config.data_column)
        write_token_file(config.data, tokenizer, out, fields=fields, workers=1, progress=progress)
    return dataclasses.replace(config, data=str(out), tokenizer=name)


def language_splits(config: TrainConfig) -> tuple[Dataset[Any], Dataset[Any]]:
    """Training and validation windows of ``config``'s data: a token file's, or the bytes of its text."""
    if config.data is not None and is_token_file(config.data):
        splits = token_splits(config.data, config.seq_len, documents=config.document_masking)
        check_fits(splits.vocab_size, model_vocab(config), TokenFile(config.data).meta.tokenizer, config.model)
        return splits.train, splits.val
    if needs_tokenizing(config):
        raise ValueError(
            f"the data {config.data} must be tokenized first (tokenizer {tokenizer_of(config)}): run "
            "python -m stagewise tokenize --data ... --tokenizer ... --out DIR, then train with --data DIR"
        )
    check_fits(256, model_vocab(config), BYTES, config.model)
    text = text_splits(config.data, config.seq_len, limit=config.data_limit)
    return text.train, text.val
