"""GPT-style decoder built as a chain: embedding, pre-norm causal blocks, final norm, LM head.

It reads token ids, or packed documents: the ids with each token's position in its own document
(:data:`Packed`). Then each token attends only to the tokens of its document before it, and its position
embedding counts from its document's start, so every document is computed as if it were run alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from stagewise.models.moe import MoE, MoEConfig

IGNORE_INDEX = -100
"""The target of a position no loss counts (padding): ``F.cross_entropy``'s default, and Hugging Face's."""

Packed = tuple[torch.Tensor, torch.Tensor]
"""Packed documents: token ids ``[batch, seq]`` and each token's position in its document (``[batch, seq]``,
counting from 0 at each document's start), Hugging Face's ``position_ids`` for packed sequences."""

Hidden = torch.Tensor | tuple[torch.Tensor, torch.Tensor]
"""What passes between a GPT's layers: the residual stream, with each token's document index for packed
documents (see :func:`documents_of`)."""


def documents_of(positions: torch.Tensor) -> torch.Tensor:
    """Each token's document, numbered from 0 along each row: a document starts wherever a position does not
    follow the one before it by 1 (Hugging Face's rule for packed ``position_ids``)."""
    before = positions[..., :1] - 1
    return (torch.diff(positions, prepend=before, dim=-1) != 1).cumsum(-1)


def document_mask(documents: torch.Tensor) -> torch.Tensor:
    """The attention mask ``[batch, 1, seq, seq]`` (True: attend) of packed documents: causal, and within each
    token's own document."""
    length = documents.shape[-1]
    causal = torch.ones(length, length, dtype=torch.bool, device=documents.device).tril()
    return (documents.unsqueeze(-1) == documents.unsqueeze(-2)).unsqueeze(1) & causal


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
    moe: MoEConfig | None = None
    """Mixture-of-experts MLPs in the blocks after ``moe.dense_layers`` (see :class:`~stagewise.models.moe.MoE`);
    None: every block's MLP is dense."""

    def __post_init__(self) -> None:
        for field in ("vocab_size", "seq_len", "d_model", "n_layers", "n_heads"):
            if getattr(self, field) < 1:
                raise ValueError(f"GPTConfig.{field} must be >= 1, got {getattr(self, field)}")
        if self.d_model % self.n_heads:
            raise ValueError(f"GPTConfig.n_heads={self.n_heads} must divide d_model={self.d_model}")
        if self.d_ff < 0:
            raise ValueError(f"GPTConfig.d_ff must be >= 0, got {self.d_ff}")
        if self.moe is not None and self.moe.dense_layers > self.n_layers:
            raise ValueError(
                f"MoEConfig.dense_layers={self.moe.dense_layers} exceeds the {self.n_layers} blocks; choose at most "
                f"{self.n_layers}"
            )

    @property
    def hidden(self) -> int:
        return self.d_ff or 4 * self.d_model

    def is_moe(self, block: int) -> bool:
        """Whether block ``block`` (from 0) has a mixture of experts for its MLP."""
        return self.moe is not None and block >= self.moe.dense_layers

    def build(self, *, device: torch.device | str | None = None) -> GPT:
        return GPT(self, device=device)

    def example(self, batch: int, seq_len: int | None = None) -> torch.Tensor:
        """Token ids of ``batch`` sequences of ``seq_len`` (the longest by default), for profiling."""
        length = seq_len or self.seq_len
        if length > self.seq_len:
            raise ValueError(f"a sequence length of {length} exceeds the model's longest, {self.seq_len}")
        return torch.zeros(batch, length, dtype=torch.long)

    def packed_example(self, batch: int, seq_len: int | None = None) -> Packed:
        """:meth:`example` as packed documents (:data:`Packed`): one document a row, for profiling."""
        ids = self.example(batch, seq_len)
        return ids, torch.arange(ids.shape[1]).expand_as(ids).contiguous()

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
        a pipeline with ``Loss(reduction="tokens")`` divides it by the global batch's count of those positions."""
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

    def forward(self, tokens: torch.Tensor | Packed) -> Hidden:
        """Ids to embeddings; packed documents (ids, positions) to embeddings and each token's document."""
        ids, positions = tokens if isinstance(tokens, tuple) else (tokens, None)
        longest = self.positions.weight.shape[0]
        if ids.shape[-1] > longest:  # on the meta device nothing else would notice
            raise ValueError(
                f"a sequence of {ids.shape[-1]} tokens is longer than the model's {longest} positions; "
                f"use at most {longest} tokens"
            )
        if positions is None:
            out: torch.Tensor = self.tokens(ids) + self.positions(torch.arange(ids.shape[-1], device=ids.device))
            return out
        if positions.shape != ids.shape:
            raise ValueError(
                f"packed documents need one position per token: ids {tuple(ids.shape)}, positions "
                f"{tuple(positions.shape)}; give positions shaped like the ids"
            )
        return self.tokens(ids) + self.positions(positions), documents_of(positions)


class Attention(nn.Module):
    """The attention half of a pre-norm block: ``x + proj(attention(qkv(norm(x))))``, causal, or within each
    packed document."""

    def __init__(self, config: GPTConfig, *, device: torch.device | str | None = None) -> None:
        super().__init__()
        d = config.d_model
        self.n_heads = config.n_heads
        self.head_dim = d // config.n_heads
        self.attn_norm = nn.LayerNorm(d, device=device)
        self.qkv = nn.Linear(d, 3 * d, device=device)
        self.proj = nn.Linear(d, d, device=device)

    def attend(self, x: torch.Tensor, documents: torch.Tensor | None) -> torch.Tensor:
        """The residual stream after the block's attention."""
        b, t, _ = x.shape
        # qkv's outputs are head by head (each head's q, k and v together), so a split of its columns over
        # tensor-parallel ranks gives each rank whole heads: -1 is the heads this rank computes.
        q, k, v = self.qkv(self.attn_norm(x)).view(b, t, -1, 3, self.head_dim).transpose(1, 2).unbind(3)
        if documents is None:
            attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            attn = F.scaled_dot_product_attention(q, k, v, attn_mask=document_mask(documents))
        out: torch.Tensor = x + self.proj(attn.transpose(1, 2).flatten(2))
        return out


class Block(Attention):
    """Pre-norm transformer block: causal self-attention then an MLP, each residual."""

    def __init__(self, config: GPTConfig, *, device: torch.device | str | None = None) -> None:
        super().__init__(config, device=device)
        d = config.d_model
        self.mlp_norm = nn.LayerNorm(d, device=device)
        self.fc = nn.Linear(d, config.hidden, device=device)
        self.out = nn.Linear(config.hidden, d, device=device)

    def forward(self, hidden: Hidden) -> Hidden:
        """The block on the residual stream; with packed documents' indices, attending within each document."""
        x, documents = hidden if isinstance(hidden, tuple) else (hidden, None)
        x = self.attend(x, documents)
        out: torch.Tensor = x + self.out(F.gelu(self.fc(self.mlp_norm(x))))
        return out if documents is None else (out, documents)


class MoEBlock(Attention):
    """Pre-norm transformer block whose MLP is a mixture of experts (:class:`~stagewise.models.moe.MoE`)."""

    def __init__(self, config: GPTConfig, *, device: torch.device | str | None = None) -> None:
        super().__init__(config, device=device)
        assert config.moe is not None  # GPT builds one only for an MoE config
        d = config.d_model
        self.mlp_norm = nn.LayerNorm(d, device=device)
        self.moe = MoE(config.moe, d, config.moe.expert_width(config.hidden), device=device)

    def forward(self, hidden: Hidden) -> Hidden:
        """The block on the residual stream; with packed documents' indices, attending within each document."""
        x, documents = hidden if isinstance(hidden, tuple) else (hidden, None)
        x = self.attend(x, documents)
        out: torch.Tensor = x + self.moe(self.mlp_norm(x))
        return out if documents is None else (out, documents)


class FinalNorm(nn.LayerNorm):
    """The layer norm after the last block; packed documents' indices, which the blocks pass on, end here."""

    def forward(self, hidden: Hidden) -> torch.Tensor:
        x = hidden[0] if isinstance(hidden, tuple) else hidden
        return super().forward(x)


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
        self.blocks = nn.ModuleList(
            (MoEBlock if config.is_moe(i) else Block)(config, device=device) for i in range(config.n_layers)
        )
        self.norm = FinalNorm(config.d_model, device=device)
        self.head = nn.Linear(config.d_model, config.vocab_size, bias=False, device=device)
        if config.tie_embeddings:
            self.head.weight = self.embed.tokens.weight

    def forward(self, ids: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Logits of ``ids``; with ``positions`` (each token's position in its document), of packed documents,
        each computed as if alone (see :data:`Packed`)."""
        x = self.embed(ids if positions is None else (ids, positions))
        for block in self.blocks:
            x = block(x)
        out: torch.Tensor = self.head(self.norm(x))
        return out
