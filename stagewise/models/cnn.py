"""A small convolutional network for images, built as a chain: stem, convolution blocks, pooled classifier head."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class CNNConfig:
    """Shape of a small image classifier."""

    in_channels: int = 3
    """Channels of the input images."""
    image_size: int = 32
    """Height and width of the input images."""
    widths: tuple[int, ...] = (32, 64, 128)
    """Channels of each resolution; each after the first starts by halving the resolution."""
    blocks_per_width: int = 2
    """Convolution blocks at each resolution."""
    n_classes: int = 10
    """Number of classes."""

    def __post_init__(self) -> None:
        for field in ("in_channels", "image_size", "blocks_per_width", "n_classes"):
            if getattr(self, field) < 1:
                raise ValueError(f"CNNConfig.{field} must be >= 1, got {getattr(self, field)}")
        if not self.widths or min(self.widths) < 1:
            raise ValueError(f"CNNConfig.widths must be positive channel counts, got {self.widths}")
        if any(w > 8 and w % 8 for w in self.widths):  # group norm: min(8, width) groups of equal size
            raise ValueError(f"CNNConfig.widths must be at most 8 or multiples of 8 (group norm), got {self.widths}")
        if self.image_size < 2 ** (len(self.widths) - 1):
            raise ValueError(
                f"CNNConfig.image_size={self.image_size} is too small to halve {len(self.widths) - 1} times"
            )

    def build(self, *, device: torch.device | str | None = None) -> SmallCNN:
        return SmallCNN(self, device=device)

    def example(self, batch: int, seq_len: int | None = None) -> torch.Tensor:
        """Images of ``batch`` samples, for profiling (``seq_len`` does not apply)."""
        return torch.zeros(batch, self.in_channels, self.image_size, self.image_size)

    def target(self, batch: int, seq_len: int | None = None) -> torch.Tensor:
        """Class labels for :meth:`example`."""
        return torch.zeros(batch, dtype=torch.long)

    @staticmethod
    def loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Cross-entropy over the classes."""
        return F.cross_entropy(logits, labels)


class ConvBlock(nn.Module):
    """3x3 convolution, GroupNorm, GELU; residual when the shape is kept."""

    def __init__(self, c_in: int, c_out: int, stride: int, *, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, device=device)
        self.norm = nn.GroupNorm(min(8, c_out), c_out, device=device)
        self.residual = c_in == c_out and stride == 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.gelu(self.norm(self.conv(x)))
        return x + y if self.residual else y


class Head(nn.Module):
    """Global average pooling and a linear classifier."""

    def __init__(self, channels: int, n_classes: int, *, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.fc = nn.Linear(channels, n_classes, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.fc(x.mean(dim=(2, 3)))
        return out


class SmallCNN(nn.Module):
    """Images ``[batch, C, H, W]`` in, logits ``[batch, n_classes]`` out; chain: ``stem``, ``blocks.*``, ``head``."""

    stagewise_chain = ("stem", "blocks", "head")

    def __init__(self, config: CNNConfig, *, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.config = config
        first = config.widths[0]
        self.stem = ConvBlock(config.in_channels, first, 1, device=device)
        blocks: list[nn.Module] = []
        c = first
        for level, width in enumerate(config.widths):
            for k in range(config.blocks_per_width):
                stride = 2 if level > 0 and k == 0 else 1
                blocks.append(ConvBlock(c, width, stride, device=device))
                c = width
        self.blocks = nn.ModuleList(blocks)
        self.head = Head(c, config.n_classes, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        out: torch.Tensor = self.head(x)
        return out
