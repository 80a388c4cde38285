"""A token file as training samples: consecutive windows of packed documents, the last part held out.

Documents are packed: joined by their end-of-text token into full windows, a document cut where a window ends
and continued in the next. With ``documents=True`` a window also says where its documents start, as each
token's position in its own document (a document cut at the window's start counts from there), and no
target crosses a document's end: the end-of-text token predicts nothing. A model that takes the positions
(stagewise's GPT, Hugging Face's through ``position_ids``) then computes each document as if it ran alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from stagewise.models.gpt import IGNORE_INDEX
from stagewise.models.text import window_index
from stagewise.run.token_file import TokenFile


class TokenWindows(Dataset[tuple[Any, torch.Tensor]]):
    """Sample ``i`` is ``seq_len`` tokens of ``source`` from token ``first`` on (documents joined by their
    end-of-text token, so a window packs whole and cut documents) and the same shifted by one: int64, read from
    the file when asked. With ``documents``, the inputs are the ids and each token's position in its document,
    and a target across a document's end is :data:`~stagewise.models.gpt.IGNORE_INDEX`."""

    def __init__(
        self, source: TokenFile, seq_len: int, *, first: int = 0, count: int | None = None, documents: bool = False
    ) -> None:
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        self.source = source
        self.first = first
        self.count = len(source) - first if count is None else count
        if self.count < seq_len + 1:
            raise ValueError(
                f"{self.count} tokens are too few for one sequence of {seq_len}; use more data or a shorter sequence"
            )
        self.seq_len = seq_len
        self.documents = documents

    def __len__(self) -> int:
        return (self.count - 1) // self.seq_len

    def __getitem__(self, index: int) -> tuple[Any, torch.Tensor]:
        start = self.first + window_index(index, len(self)) * self.seq_len
        ids = self.source.read(start, self.seq_len + 1)
        window = torch.from_numpy(ids.astype(np.int64))
        if not self.documents:
            return window[:-1], window[1:]
        cut = document_cut(self.source.starts, start, len(ids))
        targets = window[1:].clone()
        targets[torch.from_numpy(cut.crossing)] = IGNORE_INDEX
        return (window[:-1], torch.from_numpy(cut.positions[:-1])), targets


@dataclass(frozen=True)
class DocumentCut:
    """Where the documents of a window of tokens start."""

    positions: np.ndarray
    """Each token's position in its document (int64), from 0 at the document's first token or the window's."""
    crossing: np.ndarray
    """For each token but the last, whether the next one begins another document (bool)."""


def document_cut(starts: np.ndarray, start: int, count: int) -> DocumentCut:
    """The documents of tokens ``start`` to ``start + count``, given every document's first token (``starts``,
    ascending, as a token file's index holds them; found by binary search, so a mapped index is read a few
    pages at a time)."""
    tokens = np.arange(start, start + count, dtype=np.uint64)
    document = np.searchsorted(starts, tokens, side="right") - 1
    first = np.maximum(np.asarray(starts[document], dtype=np.int64), start)
    return DocumentCut(tokens.astype(np.int64) - first, document[1:] != document[:-1])


@dataclass(frozen=True)
class TokenSplits:
    """A token file cut into training and validation windows."""

    train: TokenWindows
    val: TokenWindows
    vocab_size: int
    """The tokenizer's vocabulary, which the model must embed."""


def token_splits(folder: str, seq_len: int, *, val_fraction: float = 0.05, documents: bool = False) -> TokenSplits:
    """The token file ``folder``, its last ``val_fraction`` of tokens held out for validation; ``documents`` as
    :class:`TokenWindows` takes it."""
    file = TokenFile(folder)
    total = len(file)
    cut = int(total * (1 - val_fraction))
    if total - cut < seq_len + 1:
        need = math.ceil((seq_len + 1) / val_fraction)
        raise ValueError(
            f"the validation split (the last {val_fraction:.0%} of {folder}, {total - cut} tokens) is too short "
            f"for one sequence of {seq_len} tokens; use more data (about {need} tokens) or a shorter sequence"
        )
    train = TokenWindows(file, seq_len, count=cut, documents=documents)
    val = TokenWindows(file, seq_len, first=cut, documents=documents)
    return TokenSplits(train, val, file.meta.vocab_size)
