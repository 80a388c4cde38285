"""A residual MLP built as a chain: input projection, pre-norm residual blocks, final norm, output head."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class MLPConfig:
    """Shape of a residual MLP for regression."""

    d_in: int = 32
    """Features per input sample."""
    d_model: int = 256
    """Width of the residual stream."""
    n_layers: int = 8
    """Number of residual blocks."""
    d_out: int = 8
    """Outputs per sample."""
    expansion: int = 4
    """Each block's hidden width is ``expansion * d_model``."""

    def __post_init__(self) -> None:
        for field in ("d_in", "d_model", "n_layers", "d_out", "expansion"):
            if getattr(self, field) < 1:
                raise ValueError(f"MLPConfig.{field} must be >= 1, got {getattr(self, field)}")

    def build(self, *, device: torch.device | str | None = None) -> ResidualMLP:
        return ResidualMLP(self, device=device)

    def example(self, batch: int, seq_len: int | None = None) -> torch.Tensor:
        """Inputs of ``batch`` samples, for profiling (``seq_len`` does not apply)."""
        return torch.zeros(batch, self.d_in)

    def target(self, batch: int, seq_len: int | None = None) -> torch.Tensor:
        """Targets for :meth:`example`."""
        return torch.zeros(batch, self.d_out)

    @staticmethod
    def loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Mean squared error."""
        return F.mse_loss(output, target)


class ResidualBlock(nn.Module):
    """``x + W2 gelu(W1 norm(x))``."""

    def __init__(self, d: int, hidden: int, *, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d, device=device)
        self.fc = nn.Linear(d, hidden, device=device)
        self.out = nn.Linear(hidden, d, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = x + self.out(F.gelu(self.fc(self.norm(x))))
        return out


class ResidualMLP(nn.Module):
    """Features ``[batch, d_in]`` in, ``[batch, d_out]`` out; a chain of ``inp``, ``blocks.*``, ``norm``, ``head``."""

    stagewise_chain = ("inp", "blocks", "norm", "head")

    def __init__(self, config: MLPConfig, *, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.config = config
        self.inp = nn.Linear(config.d_in, config.d_model, device=device)
        hidden = config.expansion * config.d_model
        blocks = (ResidualBlock(config.d_model, hidden, device=device) for _ in range(config.n_layers))
        self.blocks = nn.ModuleList(blocks)
        self.norm = nn.LayerNorm(config.d_model, device=device)
        self.head = nn.Linear(config.d_model, config.d_out, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        out: torch.Tensor = self.head(self.norm(x))
        return out
