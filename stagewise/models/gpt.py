"""GPT-style decoder built as a chain: embedding, pre-norm causal blocks, final norm, LM head."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

IGNORE_INDEX = -100
"""The target of a position no loss counts (padding): ``F.cross_entropy``'s default, and Hugging Face's."""


@dataclass(frozen=True)
class GPTConfig:
    """Shape of a GPT-style decoder."""

    vocab_size: int = 256
    """Number of token ids; 256 for byte-level text."""
    seq_len: int = 128
    """Longest sequence, the size of the position table."""
    d_model: int = 128
    """Width of the residual stream."""
    n_layers: int = 4
    """Number of transformer blocks."""
    n_heads: int = 4
    """Attention heads per block; must divide ``d_model``."""
    d_ff: int = 0
    """Hidden width of each block's MLP; 0 means ``4 * d_model``."""
    tie_embeddings: bool = False
    """Use the token embedding's matrix as the LM head's weight too (as GPT-2 does)."""

    def __post_init__(self) -> None:
        for field in ("vocab_size", "seq_len", "d_model", "n_layers", "n_heads"):
            if getattr(self, field) < 1:
                raise ValueError(f"GPTConfig.{field} must be >= 1, got {getattr(self, field)}")
        if self.d_model % self.n_heads:
            raise ValueError(f"GPTConfig.n_heads={self.n_heads} must divide d_model={self.d_model}")
        if self.d_ff < 0:
            raise ValueError(f"GPTConfig.d_ff must be >= 0, got {self.d_ff}")

    @property
    def hidden(self) -> int:
        return self.d_ff or 4 * self.d_model

    def build(self, *, device: torch.device | str | None = None) -> GPT:
        return GPT(self, device=device)

    def example(self, batch: int, seq_len: int | None = None) -> torch.Tensor:
        """Token ids of ``batch`` sequences of ``seq_len`` (the longest by default), for profiling."""
        length = seq_len or self.seq_len
        if length > self.seq_len:
            raise ValueError(f"a sequence length of {length} exceeds the model's longest, {self.seq_len}")
        return torch.zeros(batch, length, dtype=torch.long)

    def target(self, batch: int, seq_len: int | None = None) -> torch.Tensor:
        """Targets for :meth:`example`: the next token ids."""
        return self.example(batch, seq_len)

    @staticmethod
    def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Next-token cross-entropy, averaged over every position of every sequence."""
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    @staticmethod
    def token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Next-token cross-entropy summed over the positions whose target is not :data:`IGNORE_INDEX` (padding):
        a pipeline with ``loss_reduction="tokens"`` divides it by the global batch's count of those positions."""
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")


class Table(nn.Embedding):
    """A lookup table ``weight[rows, width]``, initialised N(0, 0.02) as in GPT-2 (so a tied LM head starts small).

    An ``nn.Embedding``, so tensor parallelism may split its rows (its vocabulary) as torch's styles split one.
    """

    def __init__(self, rows: int, width: int, *, device: torch.device | str | None = None) -> None:
        super().__init__(rows, width, device=device)

    def reset_parameters(self) -> None:
        if not self.weight.is_meta:
            nn.init.normal_(self.weight, std=0.02)


class Embedding(nn.Module):
    """Token plus learned position embedding: ids ``[batch, seq]`` to ``[batch, seq, d_model]``."""

    def __init__(self, config: GPTConfig, *, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.tokens = Table(config.vocab_size, config.d_model, device=device)
        self.positions = Table(config.seq_len, config.d_model, device=device)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        longest = self.positions.weight.shape[0]
        if ids.shape[-1] > longest:  # on the meta device nothing else would notice
            raise ValueError(
                f"a sequence of {ids.shape[-1]} tokens is longer than the model's {longest} positions; "
                f"use at most {longest} tokens"
            )
        positions = torch.arange(ids.shape[-1], device=ids.device)
        out: torch.Tensor = self.tokens(ids) + self.positions(positions)
        return out


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention then an MLP, each residual."""

    def __init__(self, config: GPTConfig, *, device: torch.device | str | None = None) -> None:
        super().__init__()
        d = config.d_model
        self.n_heads = config.n_heads
        self.head_dim = d // config.n_heads
        self.attn_norm = nn.LayerNorm(d, device=device)
        self.qkv = nn.Linear(d, 3 * d, device=device)
        self.proj = nn.Linear(d, d, device=device)
        self.mlp_norm = nn.LayerNorm(d, device=device)
        self.fc = nn.Linear(d, config.hidden, device=device)
        self.out = nn.Linear(config.hidden, d, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # qkv's outputs are head by head (each head's q, k and v together), so a split of its columns over
        # tensor-parallel ranks gives each rank whole heads: -1 is the heads this rank computes.
        q, k, v = self.qkv(self.attn_norm(x)).view(b, t, -1, 3, self.head_dim).transpose(1, 2).unbind(3)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).flatten(2))
        out: torch.Tensor = x + self.out(F.gelu(self.fc(self.mlp_norm(x))))
        return out


class GPT(nn.Module):
    """A decoder-only language model; token ids in, logits ``[batch, seq, vocab]`` out.

    It is a chain for :func:`stagewise.partition.layers_of`: ``embed``,
    ``blocks.0`` .. ``blocks.N-1``, ``norm``, ``head``. Pass ``device="meta"``
    to build it without allocating its weights. With ``tie_embeddings`` the
    head's weight is the token embedding's; split across stages, each of the
    two stages keeps a copy and :class:`stagewise.Pipeline` sums their gradients.
    """

    stagewise_chain = ("embed", "blocks", "norm", "head")

    def __init__(self, config: GPTConfig, *, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.config = config
        self.embed = Embedding(config, device=device)
        self.blocks = nn.ModuleList(Block(config, device=device) for _ in range(config.n_layers))
        self.norm = nn.LayerNorm(config.d_model, device=device)
        self.head = nn.Linear(config.d_model, config.vocab_size, bias=False, device=device)
        if config.tie_embeddings:
            self.head.weight = self.embed.tokens.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        out: torch.Tensor = self.head(self.norm(x))
        return out
