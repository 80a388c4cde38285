"""Reference models that are not chains: a masked rotary transformer, and a U-shaped MLP with long skips."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class RotaryAttentionBlock(nn.Module):
    """Pre-norm self-attention with rotary positions and a padding mask, then an MLP; ``forward(h, mask, cos, sin)``."""

    def __init__(self, d_model: int, n_heads: int, *, device: torch.device | str | None = None) -> None:
        super().__init__()
        if d_model % (2 * n_heads):
            raise ValueError(f"d_model={d_model} must be a multiple of 2 * n_heads={2 * n_heads} for rotary positions")
        self.n_heads = n_heads
        self.norm1 = nn.LayerNorm(d_model, device=device)
        self.qkv = nn.Linear(d_model, 3 * d_model, device=device)
        self.proj = nn.Linear(d_model, d_model, device=device)
        self.norm2 = nn.LayerNorm(d_model, device=device)
        self.fc = nn.Linear(d_model, 4 * d_model, device=device)
        self.out = nn.Linear(4 * d_model, d_model, device=device)

    def forward(self, h: torch.Tensor, mask: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, d = h.shape
        q, k, v = self.qkv(self.norm1(h)).view(b, t, 3, self.n_heads, d // self.n_heads).unbind(2)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask)
        h = h + self.proj(a.transpose(1, 2).reshape(b, t, d))
        out: torch.Tensor = h + self.out(F.gelu(self.fc(self.norm2(h))))
        return out


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding of ``x`` (batch, time, heads, head_dim) by angles (time, head_dim / 2)."""
    x1, x2 = x.reshape(*x.shape[:-1], -1, 2).unbind(-1)
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.stack((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1).flatten(-2)


class MaskedTransformer(nn.Module):
    """A causal language model in the style of Hugging Face's: ``forward(input_ids, attention_mask)`` -> logits.

    Not a chain: every block takes the hidden states, a boolean attention mask
    built from ``attention_mask`` (padding and causality), and the rotary
    angles, all computed once before the first block.
    """

    def __init__(
        self,
        vocab: int = 64,
        d_model: int = 32,
        n_heads: int = 2,
        n_layers: int = 4,
        *,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model, device=device)
        self.blocks = nn.ModuleList(RotaryAttentionBlock(d_model, n_heads, device=device) for _ in range(n_layers))
        self.norm = nn.LayerNorm(d_model, device=device)
        self.head = nn.Linear(d_model, vocab, bias=False, device=device)
        self.head_dim = d_model // n_heads

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        t = input_ids.shape[1]
        causal = torch.ones(t, t, dtype=torch.bool, device=input_ids.device).tril()
        mask = causal[None, None] & attention_mask.bool()[:, None, None, :]
        mask = mask | torch.eye(t, dtype=torch.bool, device=input_ids.device)  # a padded row still sees itself
        angles = torch.arange(t, device=input_ids.device, dtype=torch.float32)[:, None] * torch.pow(
            10000.0, -torch.arange(0, self.head_dim, 2, device=input_ids.device, dtype=torch.float32) / self.head_dim
        )
        cos, sin = angles.cos(), angles.sin()
        h = self.embed(input_ids)
        for block in self.blocks:
            h = block(h, mask, cos, sin)
        out: torch.Tensor = self.head(self.norm(h))
        return out


class SkipBlock(nn.Module):
    """``x + W2 gelu(W1 norm(x))``, one level of a U-shaped MLP."""

    def __init__(self, d: int, *, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d, device=device)
        self.fc = nn.Linear(d, 2 * d, device=device)
        self.out = nn.Linear(2 * d, d, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = x + self.out(F.gelu(self.fc(self.norm(x))))
        return out


class UNetMLP(nn.Module):
    """A U-shaped residual MLP: block ``i`` of the second half also adds the output of block ``n - 1 - i``.

    Not a chain: each skip connection spans several blocks, and the input
    projection's output also reaches the head.
    """

    def __init__(
        self, d_in: int = 16, d_model: int = 32, d_out: int = 4, n_layers: int = 6, *, device: str | None = None
    ) -> None:
        super().__init__()
        if n_layers < 2 or n_layers % 2:
            raise ValueError(f"n_layers must be even and at least 2, got {n_layers}")
        self.inp = nn.Linear(d_in, d_model, device=device)
        self.blocks = nn.ModuleList(SkipBlock(d_model, device=device) for _ in range(n_layers))
        self.mix = nn.Parameter(torch.full((n_layers // 2,), 1 / math.sqrt(2), device=device))
        self.head = nn.Linear(2 * d_model, d_out, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        first = h
        half = len(self.blocks) // 2
        saved: list[torch.Tensor] = []
        for i, block in enumerate(self.blocks):
            if i >= half:
                h = h + self.mix[i - half] * saved[len(self.blocks) - 1 - i]
            h = block(h)
            if i < half:
                saved.append(h)
        out: torch.Tensor = self.head(torch.cat([h, first], dim=-1))
        return out
