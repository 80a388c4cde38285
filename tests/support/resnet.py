"""A small ResNet for tests, with batch norms: a stem, basic blocks with skip connections and a head, as a chain."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Stem(nn.Module):
    """3x3 convolution, batch norm, ReLU."""

    def __init__(self, c_in: int, c_out: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c_in, c_out, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(c_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.bn(self.conv(x)))


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with batch norms, added to the input (through a 1x1 convolution and a batch norm
    where the shape changes), then ReLU: ResNet-18's block."""

    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False), nn.BatchNorm2d(c_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class Head(nn.Module):
    """Global average pooling and a linear classifier."""

    def __init__(self, channels: int, n_classes: int) -> None:
        super().__init__()
        self.fc = nn.Linear(channels, n_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.fc(x.mean(dim=(2, 3)))
        return out


class ResNet(nn.Module):
    """Images ``[batch, in_channels, H, W]`` in, logits out; chain: ``stem``, ``blocks.0`` ..., ``head``.

    Each width after the first starts with a block that halves the resolution (with a projected shortcut).
    """

    stagewise_chain = ("stem", "blocks", "head")

    def __init__(
        self, widths: tuple[int, ...] = (4, 8), blocks_per_width: int = 2, in_channels: int = 3, n_classes: int = 3
    ) -> None:
        super().__init__()
        self.stem = Stem(in_channels, widths[0])
        blocks: list[nn.Module] = []
        c = widths[0]
        for level, width in enumerate(widths):
            for k in range(blocks_per_width):
                blocks.append(BasicBlock(c, width, 2 if level > 0 and k == 0 else 1))
                c = width
        self.blocks = nn.ModuleList(blocks)
        self.head = Head(c, n_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        out: torch.Tensor = self.head(x)
        return out


def resnet(seed: int = 0, *, cumulative: str | None = "blocks.1.bn2") -> ResNet:
    """The test ResNet (widths 4 and 8, two blocks each: 6 layers, 10 batch norms) initialised from ``seed``;
    the batch norm named ``cumulative`` keeps a cumulative average (``momentum=None``)."""
    torch.manual_seed(seed)
    model = ResNet()
    if cumulative is not None:
        norm = model.get_submodule(cumulative)
        assert isinstance(norm, nn.BatchNorm2d)
        norm.momentum = None
    return model
