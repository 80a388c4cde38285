"""Three AdamW steps with clipping of a small GPT, unsplit in one process: what sharded and compiled stages equal."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from stagewise.models.gpt import GPT, GPTConfig

STEPS = 3
CLIP = 0.05
BATCH = 8


def config(*, tied: bool) -> GPTConfig:
    """Four blocks of width 32 over a 64-token vocabulary; 7 layers as a chain (embed, 4 blocks, norm, head)."""
    return GPTConfig(vocab_size=64, seq_len=8, d_model=32, n_layers=4, n_heads=4, tie_embeddings=tied)


def model(*, tied: bool) -> GPT:
    torch.manual_seed(3)
    return config(tied=tied).build()


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The :data:`STEPS` global batches of :data:`BATCH` sequences, and their next-token targets."""
    g = torch.Generator().manual_seed(5)
    out = []
    for _ in range(STEPS):
        ids = torch.randint(0, 64, (BATCH, 8), generator=g)
        out.append((ids, torch.roll(ids, -1, dims=1)))
    return out


def unsplit(*, tied: bool) -> dict[str, Any]:
    """The unsplit model's losses, clipped norms and gradients per step, and its parameters after the last."""
    return train_unsplit(model(tied=tied))


def train_unsplit(net: nn.Module, after_backward: Callable[[nn.Module], float] | None = None) -> dict[str, Any]:
    """``net`` trained in one process on :func:`batches` by AdamW with clipping: its losses, clipped norms and
    gradients per step, and its parameters after the last. ``after_backward(net)``, called after each backward,
    returns what to add to the step's loss (a mixture of experts' balance loss, say)."""
    torch.set_num_threads(1)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    losses, norms, grads = [], [], []
    for ids, targets in batches():
        opt.zero_grad()
        loss = GPTConfig.loss(net(ids), targets)
        loss.backward()
        losses.append(loss.item() + (after_backward(net) if after_backward is not None else 0.0))
        grads.append({n: p.grad.clone() for n, p in net.named_parameters(remove_duplicate=False)})
        norms.append(float(torch.nn.utils.clip_grad_norm_(net.parameters(), CLIP)))
        opt.step()
    return {
        "losses": losses,
        "norms": norms,
        "grads": grads,
        "params": dict(net.named_parameters(remove_duplicate=False)),
    }
