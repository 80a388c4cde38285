"""Named model presets, from laptop-sized to 70B parameters (the large ones for planning on the meta device)."""

from __future__ import annotations

from typing import TypeAlias

import torch
from torch import nn

from stagewise.models.cnn import CNNConfig
from stagewise.models.gpt import GPTConfig
from stagewise.models.mlp import MLPConfig
from stagewise.models.moe import MoEConfig

ModelConfig: TypeAlias = GPTConfig | MLPConfig | CNNConfig
"""The shape of a reference model; each has ``build(device=)``, ``example(batch, seq_len)`` and ``loss``."""

PRESETS: dict[str, ModelConfig] = {
    "gpt-tiny": GPTConfig(vocab_size=256, seq_len=128, d_model=128, n_layers=4, n_heads=4),
    "gpt-tiny-tied": GPTConfig(vocab_size=256, seq_len=128, d_model=128, n_layers=4, n_heads=4, tie_embeddings=True),
    "gpt-small": GPTConfig(vocab_size=50304, seq_len=1024, d_model=768, n_layers=12, n_heads=12, tie_embeddings=True),
    "gpt-medium": GPTConfig(vocab_size=50304, seq_len=1024, d_model=1024, n_layers=24, n_heads=16),
    "gpt-1.3b": GPTConfig(vocab_size=50304, seq_len=2048, d_model=2048, n_layers=24, n_heads=16),
    "gpt-7b": GPTConfig(vocab_size=32000, seq_len=2048, d_model=4096, n_layers=32, n_heads=32),
    "gpt-13b": GPTConfig(vocab_size=32000, seq_len=2048, d_model=5120, n_layers=40, n_heads=40),
    "gpt-70b": GPTConfig(vocab_size=32000, seq_len=4096, d_model=8192, n_layers=80, n_heads=64, d_ff=36864),
    "gpt-moe-tiny": GPTConfig(
        vocab_size=256,
        seq_len=128,
        d_model=128,
        n_layers=4,
        n_heads=4,
        moe=MoEConfig(experts=8, top_k=2, shared_experts=1, dense_layers=1),
    ),
    "gpt-moe-671b": GPTConfig(  # DeepSeek-V3's shape, with multi-head attention for its multi-head latent attention
        vocab_size=129280,
        seq_len=4096,
        d_model=7168,
        n_layers=61,
        n_heads=128,
        d_ff=18432,
        moe=MoEConfig(
            experts=256, top_k=8, d_expert=2048, shared_experts=1, dense_layers=3, scoring="sigmoid", balancing="bias"
        ),
    ),
    "mlp-tiny": MLPConfig(d_in=32, d_model=256, n_layers=8, d_out=8),
    "mlp-large": MLPConfig(d_in=1024, d_model=8192, n_layers=48, d_out=1024),
    "cnn-tiny": CNNConfig(in_channels=3, image_size=32, widths=(16, 32, 64), blocks_per_width=2, n_classes=10),
}
"""Model shapes by name. ``gpt-small`` is GPT-2 small (tied embedding and head); ``gpt-70b`` has 7.0e10 parameters.
``gpt-moe-tiny`` is a mixture of experts for a laptop (8 experts, top 2, one shared); ``gpt-moe-671b`` has
DeepSeek-V3's shape (256 experts, top 8, one shared, 3 dense blocks first; 6.7e11 parameters, 3.8e10 active per
token) with multi-head attention in place of its latent attention, for planning on the meta device."""


def preset(name: str) -> ModelConfig:
    """The configuration of preset ``name``."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; choose one of {sorted(PRESETS)}")
    return PRESETS[name]


def build(name: str, *, device: torch.device | str | None = None) -> nn.Module:
    """The preset model ``name``; ``device="meta"`` builds it without allocating weights."""
    return preset(name).build(device=device)
