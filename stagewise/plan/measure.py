"""What ``workload()`` times beside the layers: the optimizer step, and the loss's seconds and bytes."""

from __future__ import annotations

import copy
import logging
import statistics
import time
from typing import Any, Literal, TypeAlias

import torch
from torch import nn

from stagewise.comm.payload import Payload, as_tensors
from stagewise.partition.live_bytes import LiveBytes
from stagewise.pipeline import LossFn

log = logging.getLogger(__name__)

OptimizerKind: TypeAlias = Literal["adamw", "sgd"]
"""The optimizers ``stagewise train`` uses: AdamW, or SGD with momentum 0.9."""


def measure_optimizer(
    device: torch.device, *, kind: OptimizerKind = "adamw", params: int = 1 << 24, repeats: int = 5
) -> float:
    """Seconds per parameter of one step of ``kind`` on ``device`` (median of ``repeats``)."""
    weight = torch.nn.Parameter(torch.zeros(params, device=device))
    weight.grad = torch.ones_like(weight)
    optimizer: torch.optim.Optimizer = (
        torch.optim.SGD([weight], lr=1e-3, momentum=0.9) if kind == "sgd" else torch.optim.AdamW([weight], lr=1e-3)
    )
    times = []
    for _ in range(repeats + 1):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        began = time.perf_counter()
        optimizer.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - began)
    return statistics.median(times[1:]) / params


def measure_loss(
    model: nn.Module,
    sample: Payload,
    loss: tuple[LossFn, Payload],
    device: torch.device,
    *,
    repeats: int = 5,
    output: Payload | None = None,
) -> tuple[float, float]:
    """Forward and backward seconds of ``loss_fn(output, target)`` on ``device`` (medians of ``repeats``);
    ``output``: the model's output for ``sample`` on the meta device, where already known."""
    loss_fn, target = loss
    outputs = _to(meta_output(model, sample) if output is None else output, device, random=True)
    target = _to(target, device)
    forward, backward = [], []
    for _ in range(repeats + 1):
        inputs = _to(outputs, device, fresh=True)
        began = time.perf_counter()
        value = loss_fn(inputs, target)
        _sync(device)
        middle = time.perf_counter()
        torch.autograd.backward([value])
        _sync(device)
        forward.append(middle - began)
        backward.append(time.perf_counter() - middle)
    return statistics.median(forward[1:]), statistics.median(backward[1:])


def measure_loss_bytes(
    model: nn.Module, sample: Payload, loss: tuple[LossFn, Payload], *, output: Payload | None = None
) -> int | None:
    """Bytes the loss's forward and backward hold at their fullest, with the model's output they read, counted
    on the meta device (:class:`~stagewise.partition.live_bytes.LiveBytes`); None where the loss cannot run there
    (it reads values). For cross-entropy on logits: the logits, their log-softmax and the gradients of both.
    ``output`` as for :func:`measure_loss`."""
    loss_fn, target = loss
    outputs = _to(meta_output(model, sample) if output is None else output, torch.device("meta"), fresh=True)
    try:
        with LiveBytes() as live:
            torch.autograd.backward([loss_fn(outputs, _to(target, torch.device("meta")))])
    except Exception as err:  # a loss that reads values (.item(), .numpy()) or has no meta kernel: not counted
        log.debug("the loss cannot run on the meta device (%s: %s); its working memory is not counted",
                  type(err).__name__, err)  # fmt: skip
        return None
    return int(live.peak) + sum(int(t.untyped_storage().nbytes()) for t in as_tensors(outputs)[0])


def meta_output(model: nn.Module, sample: Payload) -> Payload:
    """The model's output for ``sample``, on the meta device (only its shape is wanted)."""
    on_meta = all(t.is_meta for t in (*model.parameters(), *model.buffers()))
    shaper = model if on_meta else copy.deepcopy(model).to("meta")
    with torch.device("meta"):
        return shaper(_to(sample, torch.device("meta")))  # type: ignore[no-any-return]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _to(payload: Any, device: torch.device, *, random: bool = False, fresh: bool = False) -> Any:
    """``payload`` on ``device``: as is, as random values of its shape, or as fresh leaves that require grad."""
    tensors, is_tuple = as_tensors(payload)
    out = []
    for t in tensors:
        if random:
            t = torch.randn(t.shape, device=device) if t.is_floating_point() else torch.zeros(t.shape, device=device)
        elif fresh:
            t = t.detach().clone().requires_grad_(t.is_floating_point())
        else:
            t = t.to(device)
        out.append(t)
    return tuple(out) if is_tuple else out[0]
