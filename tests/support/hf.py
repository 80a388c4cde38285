"""Tiny Hugging Face models built from configs (nothing downloaded), without dropout, as a user brings them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import torch
import torch.nn.functional as F
import transformers
from torch import nn

transformers.logging.set_verbosity_error()

Kind = Literal["gpt2", "llama", "bert"]
KINDS: tuple[Kind, ...] = ("gpt2", "llama", "bert")
VOCAB = 96
LIMIT = 48
"""The models' max_position_embeddings."""


def config(kind: Kind, layers: int = 3) -> transformers.PretrainedConfig:
    """The config of a tiny model of ``kind``: GPT-2 with its head tied to the embedding, Llama with rotary
    embeddings, RMSNorm and grouped-query attention, BERT with a padding mask."""
    if kind == "gpt2":
        return transformers.GPT2Config(
            n_layer=layers, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=LIMIT, tie_word_embeddings=True,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
        )  # fmt: skip
    if kind == "llama":
        return transformers.LlamaConfig(
            num_hidden_layers=layers, hidden_size=32, intermediate_size=64, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=LIMIT, bos_token_id=0, eos_token_id=0,
        )  # fmt: skip
    return transformers.BertConfig(
        num_hidden_layers=layers, hidden_size=32, intermediate_size=64, num_attention_heads=2, vocab_size=VOCAB,
        max_position_embeddings=LIMIT, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip


def build(kind: Kind, layers: int = 3, *, meta: bool = False) -> nn.Module:
    """The model of ``kind`` for training (a causal LM, or BERT for masked LM), on the meta device if asked."""
    cls = {"gpt2": transformers.GPT2LMHeadModel, "llama": transformers.LlamaForCausalLM}.get(
        kind, transformers.BertForMaskedLM
    )
    if meta:
        with torch.device("meta"):
            return cls(config(kind, layers)).train()
    return cls(config(kind, layers)).train()


def batch(size: int, length: int, *, seed: int) -> dict[str, torch.Tensor]:
    """Token ids with an attention mask that pads the end of some samples."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (size, length), generator=g)
    mask = torch.ones(size, length, dtype=torch.long)
    for row in range(0, size, 2):
        mask[row, length - 1 - row % (length - 1) :] = 0
    return {"input_ids": ids, "attention_mask": mask}


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy averaged over every position."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def steps(size: int, lengths: Sequence[int]) -> list[tuple[dict[str, torch.Tensor], torch.Tensor]]:
    """One batch of ``size`` samples per length (seeded by its place), with next-token targets."""
    out = []
    for k, length in enumerate(lengths):
        inputs = batch(size, length, seed=k)
        out.append((inputs, torch.roll(inputs["input_ids"], -1, dims=1)))
    return out


def train_unsplit(
    model: nn.Module, data: list[tuple[dict[str, torch.Tensor], torch.Tensor]], lr: float
) -> dict[str, Any]:
    """``model`` (initialised already) trained by SGD on whole batches of ``data`` on :func:`lm_loss`, in one
    process: its losses and its state after them."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for inputs, targets in data:
        opt.zero_grad()
        loss = lm_loss(model(**inputs).logits, targets)
        loss.backward()
        losses.append(loss.item())
        opt.step()
    return {"losses": losses, "state": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def train_pipeline(pipe: Any, data: list[tuple[dict[str, torch.Tensor], torch.Tensor]], lr: float) -> dict[str, Any]:
    """A :class:`~stagewise.Pipeline` trained by SGD on ``data``: its losses, and its (unsplit-named) state after."""
    opt = torch.optim.SGD(pipe.parameters(), lr=lr)
    losses = []
    for inputs, targets in data:
        opt.zero_grad()
        losses.append(pipe.step(inputs, targets).item())
        opt.step()
    return {"losses": losses, "params": pipe.state_dict()}
