"""Packed documents with document masking: each document's loss and gradients are those it has run alone.

A packed window holds whole and cut documents joined by their end-of-text token. With its positions
(each token's place in its own document), stagewise's GPT and a Hugging Face Llama attend only within each
document and restart their positions, and the window's targets leave out every target across a document's end.
So each document's summed loss equals the loss of that document run alone (right-padded, padding ignored),
and the packed batch's gradient equals the sum of the documents' gradients run alone.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from stagewise.models import GPTConfig
from stagewise.models.gpt import IGNORE_INDEX, documents_of
from stagewise.partition import capture
from stagewise.run.token_windows import document_cut
from tests.support import hf

LENGTH = 24
"""Tokens in a packed row."""
ATOL = 1e-5
RTOL = {torch.float64: 0.0, torch.float32: 1e-5}
"""In float32 a gradient summed over a dozen documents differs from the packed one by reassociation alone: up to
1.3e-5 on entries near 2 (a relative 6e-6). In float64 the absolute bound holds alone."""
DTYPES = pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])

Forward = Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]
"""Logits of ids, with each token's position in its document for packed rows (None: one sequence a row)."""


@dataclass(frozen=True)
class Packed:
    """Rows of packed documents, and each document's tokens as it is alone."""

    ids: torch.Tensor
    positions: torch.Tensor
    targets: torch.Tensor
    pieces: list[torch.Tensor]
    """Each document's part in a row (the window's tokens and the next one), in row order."""


def _packed(vocab: int, seed: int, rows: int = 2) -> Packed:
    """``rows`` windows cut from a stream of documents 1 to 9 tokens long, each ending with token 0 (end of
    text), the first window starting inside a document."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 10, size=64)
    starts = np.concatenate([[0], np.cumsum(lengths)]).astype(np.uint64)
    stream = rng.integers(1, vocab, size=int(starts[-1]))
    stream[starts[1:] - 1] = 0
    ids, positions, targets, pieces = [], [], [], []
    for row in range(rows):
        start = 3 + row * LENGTH  # document 0 is cut at the first window's start
        window = torch.from_numpy(stream[start : start + LENGTH + 1].astype(np.int64))
        cut = document_cut(starts, start, LENGTH + 1)
        row_targets = window[1:].clone()
        row_targets[torch.from_numpy(cut.crossing)] = IGNORE_INDEX
        ids.append(window[:-1])
        positions.append(torch.from_numpy(cut.positions[:-1]))
        targets.append(row_targets)
        documents = documents_of(positions[-1])
        for document in documents.unique():
            where = (documents == document).nonzero().flatten()
            pieces.append(window[int(where[0]) : int(where[-1]) + 2])
    return Packed(torch.stack(ids), torch.stack(positions), torch.stack(targets), pieces)


def _summed(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")


def _alone(forward: Forward, piece: torch.Tensor) -> torch.Tensor:
    """The summed loss of one document run alone, right-padded to a full row (padding ignored)."""
    ids = torch.zeros(1, LENGTH, dtype=torch.long)
    targets = torch.full((1, LENGTH), IGNORE_INDEX)
    ids[0, : len(piece) - 1] = piece[:-1]
    targets[0, : len(piece) - 1] = piece[1:]
    targets[0, len(piece) - 2] = IGNORE_INDEX if piece[-2] == 0 else piece[-1]  # an end of text predicts nothing
    return _summed(forward(ids, None), targets)


def _per_document(logits: torch.Tensor, packed: Packed) -> list[torch.Tensor]:
    losses = F.cross_entropy(
        logits.flatten(0, 1).float(), packed.targets.flatten(), ignore_index=IGNORE_INDEX, reduction="none"
    ).view_as(packed.targets)
    documents = documents_of(packed.positions)
    return [losses[row][documents[row] == d].sum() for row in range(len(losses)) for d in documents[row].unique()]


def _check(model: nn.Module, forward: Forward, packed: Packed, dtype: torch.dtype) -> None:
    model.to(dtype)
    tolerance = {"atol": ATOL, "rtol": RTOL[dtype]}
    logits = forward(packed.ids, packed.positions)
    each = _per_document(logits, packed)
    assert len(each) == len(packed.pieces) >= 10
    model.zero_grad()
    _summed(logits, packed.targets).backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    alone = []
    model.zero_grad()
    for piece in packed.pieces:
        loss = _alone(forward, piece)
        loss.backward()
        alone.append(loss.detach())
    torch.testing.assert_close(torch.stack(each).detach(), torch.stack(alone), **tolerance)
    assert grads.keys() == {name for name, p in model.named_parameters() if p.grad is not None}
    for name, p in model.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, **tolerance, msg=lambda m, n=name: f"{n}: {m}")


@DTYPES
def test_gpt_packed_documents_have_the_loss_and_gradients_of_each_document_alone(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    model = GPTConfig(vocab_size=64, seq_len=32, d_model=32, n_layers=2, n_heads=4).build()
    packed = _packed(64, seed=1)

    def forward(ids: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
        out: torch.Tensor = model(ids, positions)
        return out

    _check(model, forward, packed, dtype)


def test_without_the_positions_packed_documents_attend_across_their_ends() -> None:
    """The check above can fail: the same windows without document masking give other losses."""
    torch.manual_seed(0)
    model = GPTConfig(vocab_size=64, seq_len=32, d_model=32, n_layers=2, n_heads=4).build()
    packed = _packed(64, seed=1)
    each = _per_document(model(packed.ids), packed)
    alone = [_alone(lambda ids, _: model(ids), piece) for piece in packed.pieces]
    assert not torch.allclose(torch.stack(each), torch.stack(alone), atol=1e-3)


@DTYPES
@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_hf_llama_packed_through_position_ids_has_each_document_alone(attention: str, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    model = hf.build("llama")
    model.config._attn_implementation = attention
    packed = _packed(hf.VOCAB, seed=2)

    def forward(ids: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
        keywords = {"input_ids": ids} if positions is None else {"input_ids": ids, "position_ids": positions}
        out: torch.Tensor = model(**keywords, use_cache=False).logits
        return out

    _check(model, forward, packed, dtype)


@DTYPES
def test_hf_llama_captured_with_position_ids_keeps_each_document_alone(dtype: torch.dtype) -> None:
    """The chain stagewise splits (torch.export's capture) computes the same as the model it was captured from:
    packed rows, and rows of one document each (positions counting from 0)."""
    torch.manual_seed(0)
    model = hf.build("llama")
    packed = _packed(hf.VOCAB, seed=3)
    chain = capture(model, {"input_ids": packed.ids, "position_ids": packed.positions})

    def forward(ids: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
        if positions is None:
            positions = torch.arange(ids.shape[1]).expand_as(ids)
        out: torch.Tensor = chain(input_ids=ids, position_ids=positions)
        return out

    _check(chain, forward, packed, dtype)


def test_positions_that_are_not_one_per_token_are_refused() -> None:
    model = GPTConfig(vocab_size=64, seq_len=32, d_model=32, n_layers=1, n_heads=4).build(device="meta")
    ids = torch.zeros(2, 8, dtype=torch.long, device="meta")
    with pytest.raises(ValueError, match=r"^packed documents need one position per token: ids \(2, 8\), positions "):
        model(ids, ids[:, 1:])
