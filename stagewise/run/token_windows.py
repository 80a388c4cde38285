"""A token file as training samples: consecutive windows of packed documents, the last part held out."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.data import Dataset

from stagewise.models.text import window_index
from stagewise.run.token_file import TokenFile


class TokenWindows(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Sample ``i`` is ``seq_len`` tokens of ``source`` from token ``first`` on (documents joined by their
    end-of-text token, so a window packs whole and cut documents) and the same shifted by one: int64, read from
    the file when asked."""

    def __init__(self, source: TokenFile, seq_len: int, *, first: int = 0, count: int | None = None) -> None:
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

    def __len__(self) -> int:
        return (self.count - 1) // self.seq_len

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = self.first + window_index(index, len(self)) * self.seq_len
        ids = self.source.read(start, self.seq_len + 1)
        window = torch.from_numpy(ids.astype(np.int64))
        return window[:-1], window[1:]


@dataclass(frozen=True)
class TokenSplits:
    """A token file cut into training and validation windows."""

    train: TokenWindows
    val: TokenWindows
    vocab_size: int
    """The tokenizer's vocabulary, which the model must embed."""


def token_splits(folder: str, seq_len: int, *, val_fraction: float = 0.05) -> TokenSplits:
    """The token file ``folder``, its last ``val_fraction`` of tokens held out for validation."""
    file = TokenFile(folder)
    total = len(file)
    cut = int(total * (1 - val_fraction))
    if total - cut < seq_len + 1:
        need = math.ceil((seq_len + 1) / val_fraction)
        raise ValueError(
            f"the validation split (the last {val_fraction:.0%} of {folder}, {total - cut} tokens) is too short "
            f"for one sequence of {seq_len} tokens; use more data (about {need} tokens) or a shorter sequence"
        )
    train = TokenWindows(file, seq_len, count=cut)
    return TokenSplits(train, TokenWindows(file, seq_len, first=cut), file.meta.vocab_size)
