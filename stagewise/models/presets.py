"""Named model presets, from laptop-sized to 7B parameters (for planning on the meta device)."""

from __future__ import annotations

import torch
from torch import nn

from stagewise.models.gpt import GPT, GPTConfig

PRESETS: dict[str, GPTConfig] = {
    "gpt-tiny": GPTConfig(vocab_size=256, seq_len=128, d_model=128, n_layers=4, n_heads=4),
    "gpt-small": GPTConfig(vocab_size=50304, seq_len=1024, d_model=768, n_layers=12, n_heads=12),
    "gpt-medium": GPTConfig(vocab_size=50304, seq_len=1024, d_model=1024, n_layers=24, n_heads=16),
    "gpt-1.3b": GPTConfig(vocab_size=50304, seq_len=2048, d_model=2048, n_layers=24, n_heads=16),
    "gpt-7b": GPTConfig(vocab_size=32000, seq_len=2048, d_model=4096, n_layers=32, n_heads=32),
}
"""GPT shapes by name; ``gpt-small`` is GPT-2 small, ``gpt-7b`` has 6.7e9 parameters."""


def build(name: str, *, device: torch.device | str | None = None) -> nn.Module:
    """The preset model ``name``; ``device="meta"`` builds it without allocating weights."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; choose one of {sorted(PRESETS)}")
    return GPT(PRESETS[name], device=device)
