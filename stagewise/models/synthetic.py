"""Synthetic data with something to learn, for the MLP (a fixed teacher network) and the CNN (class patterns)."""

from __future__ import annotations

import torch
from torch.utils.data import TensorDataset

from stagewise.models.cnn import CNNConfig
from stagewise.models.mlp import MLPConfig


def teacher_regression(config: MLPConfig, n: int, *, seed: int = 0) -> TensorDataset:
    """``n`` samples ``(x, y)`` with ``x ~ N(0, 1)`` and ``y`` a fixed random two-layer network's output."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, config.d_in, generator=g)
    w1 = torch.randn(config.d_in, 4 * config.d_out, generator=g) / config.d_in**0.5
    w2 = torch.randn(4 * config.d_out, config.d_out, generator=g) / (4 * config.d_out) ** 0.5
    return TensorDataset(x, torch.tanh(x @ w1) @ w2)


def pattern_images(config: CNNConfig, n: int, *, seed: int = 0, noise: float = 1.0) -> TensorDataset:
    """``n`` images ``(x, label)``: each class a fixed smooth random pattern, plus Gaussian noise."""
    g = torch.Generator().manual_seed(seed)
    c, size = config.in_channels, config.image_size
    coarse = torch.randn(config.n_classes, c, 4, 4, generator=g)
    patterns = torch.nn.functional.interpolate(coarse, size=(size, size), mode="bilinear", align_corners=False)
    labels = torch.randint(0, config.n_classes, (n,), generator=g)
    images = patterns[labels] + noise * torch.randn(n, c, size, size, generator=g)
    return TensorDataset(images, labels)
