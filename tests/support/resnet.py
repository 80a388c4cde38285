"""A small ResNet (no torchvision) laid out as a chain: a stem, basic blocks with batch norm and skips, a head."""

from __future__ import annotations

import torch
from torch import nn


class BasicBlock(nn.Module):
    """conv-BN-ReLU, conv-BN, plus the input (projected when the width or stride changes), then ReLU."""

    def __init__(self, width_in: int, width: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(width_in, width, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.skip: nn.Module = nn.Identity()
        if stride != 1 or width_in != width:
            self.skip = nn.Sequential(nn.Conv2d(width_in, width, 1, stride=stride, bias=False), nn.BatchNorm2d(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(out)) + self.skip(x))


def resnet(widths: tuple[int, ...] = (8, 16), classes: int = 10) -> nn.Sequential:
    """Stem (conv-BN-ReLU), one basic block per width (the later ones halve the resolution), pooling and a
    linear head: 2 + len(widths) layers for the partitioner."""
    blocks: list[nn.Module] = [
        nn.Sequential(nn.Conv2d(3, widths[0], 3, padding=1, bias=False), nn.BatchNorm2d(widths[0]), nn.ReLU())
    ]
    for k, width in enumerate(widths):
        blocks.append(BasicBlock(widths[max(k - 1, 0)], width, stride=1 if k == 0 else 2))
    blocks.append(nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(widths[-1], classes)))
    return nn.Sequential(*blocks)
