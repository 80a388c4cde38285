"""Synthetic data with something to learn, for the MLP (a fixed teacher network) and the CNN (class patterns)."""

from __future__ import annotations

import torch
from torch.utils.data import TensorDataset

from stagewise.models.cnn import CNNConfig
from stagewise.models.mlp import MLPConfig


def teacher_regression(config: MLPConfig, n: int, *, seed: int = 0, teacher: int = 0) -> TensorDataset:
    """``n`` samples ``(x, y)``: ``x ~ N(0, 1)`` drawn from ``seed``, ``y`` the output of a random two-layer
    network fixed by ``teacher`` (so training and validation sets from different seeds share it)."""
    t = torch.Generator().manual_seed(teacher)
    w1 = torch.randn(config.d_in, 4 * config.d_out, generator=t) / config.d_in**0.5
    w2 = torch.randn(4 * config.d_out, config.d_out, generator=t) / (4 * config.d_out) ** 0.5
    x = torch.randn(n, config.d_in, generator=torch.Generator().manual_seed(seed))
    return TensorDataset(x, torch.tanh(x @ w1) @ w2)


def pattern_images(
    config: CNNConfig, n: int, *, seed: int = 0, noise: float = 1.0, patterns_seed: int = 0
) -> TensorDataset:
    """``n`` images ``(x, label)`` drawn from ``seed``: each class a smooth random pattern fixed by
    ``patterns_seed`` (shared by training and validation sets), plus Gaussian noise."""
    c, size = config.in_channels, config.image_size
    coarse = torch.randn(config.n_classes, c, 4, 4, generator=torch.Generator().manual_seed(patterns_seed))
    g = torch.Generator().manual_seed(seed)
    patterns = torch.nn.functional.interpolate(coarse, size=(size, size), mode="bilinear", align_corners=False)
    labels = torch.randint(0, config.n_classes, (n,), generator=g)
    images = patterns[labels] + noise * torch.randn(n, c, size, size, generator=g)
    return TensorDataset(images, labels)
