"""Tiny Hugging Face models built from configs (nothing downloaded), without dropout, as a user brings them."""

from __future__ import annotations

from typing import Literal

import torch
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
