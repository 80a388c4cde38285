"""Small chains of layers for pipeline tests, built deterministically from a spec."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

KINDS = ("linear", "gelu", "norm", "residual", "twice")


class Residual(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.up = nn.Linear(d, 2 * d)
        self.down = nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = x + self.down(F.gelu(self.up(x)))
        return out


class Twice(nn.Module):
    """One linear applied twice: its second read of the weights depends on its first."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.proj = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.proj(torch.tanh(self.proj(x)))
        return out


class Pair(nn.Module):
    """Applies a layer to the hidden state and passes the integer ids on: (hidden, ids) -> (hidden, ids)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        return self.inner(x[0]), x[1]


class Mix(nn.Module):
    """Uses the integer ids: hidden + embedding(ids)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.table = nn.Embedding(10, d)

    def forward(self, x: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        return x[0] + self.table(x[1]), x[1]


class Unpair(nn.Module):
    def forward(self, x: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return x[0]


def layer(kind: str, d: int) -> nn.Module:
    if kind == "linear":
        return nn.Linear(d, d)
    if kind == "gelu":
        return nn.GELU()
    if kind == "norm":
        return nn.LayerNorm(d)
    if kind == "twice":
        return Twice(d)
    return Residual(d)


@dataclass(frozen=True)
class Chain:
    """What to build: layer kinds, width, and whether a (hidden, ids) tuple flows between layers."""

    kinds: tuple[str, ...]
    width: int = 8
    with_ids: bool = False
    seed: int = 0

    @property
    def n_layers(self) -> int:
        return len(self.kinds) + (2 if self.with_ids else 0)

    def build(self) -> nn.Sequential:
        torch.manual_seed(self.seed)
        if not self.with_ids:
            return nn.Sequential(*(layer(k, self.width) for k in self.kinds))
        half = len(self.kinds) // 2
        parts: list[nn.Module] = [Pair(layer(k, self.width)) for k in self.kinds[:half]]
        parts.append(Mix(self.width))
        parts += [Pair(layer(k, self.width)) for k in self.kinds[half:]]
        parts.append(Unpair())
        return nn.Sequential(*parts)

    def batch(self, size: int, step: int) -> tuple[object, torch.Tensor]:
        g = torch.Generator().manual_seed(1000 * self.seed + step)
        x = torch.randn(size, self.width, generator=g)
        y = torch.randn(size, self.width, generator=g)
        if self.with_ids:
            return (x, torch.randint(0, 10, (size,), generator=g)), y
        return x, y


def mse(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(output, target)


def reference(chain: Chain, batch: int, steps: int, lr: float = 0.05) -> dict[str, object]:
    """Plain single-process training of the unsplit chain on the same batches."""
    model = chain.build()
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=lr) if params else None  # a chain of GELUs has nothing to train
    losses, first_grads = [], {}
    for step in range(steps):
        x, y = chain.batch(batch, step)
        loss = mse(model(x), y)
        if opt is not None:
            opt.zero_grad()
            loss.backward()
        losses.append(loss.item())
        if step == 0:
            first_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        if opt is not None:
            opt.step()
    return {
        "losses": losses,
        "grads": first_grads,
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
    }
