"""Gradient clipping by the norm of the whole model's gradients, spread over the ranks of a pipeline."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.utils import clip_grads_with_norm_, get_total_norm

from stagewise.comm import named_collective


def clip_grad_norm_(
    parameters: Iterable[nn.Parameter],
    max_norm: float,
    norm_type: float = 2.0,
    *,
    group: dist.ProcessGroup,
    counted: Iterable[nn.Parameter] | None = None,
    error_if_nonfinite: bool = False,
    device: torch.device | None = None,
    timeout: float | None = None,
) -> torch.Tensor:
    """Clip ``parameters``' gradients by the total norm of all gradients held across ``group``; returns that norm.

    Each rank passes its own parameters, which no other rank in ``group``
    holds. The local norms are combined with one all-reduce (a sum of
    ``norm ** p``, or a max for the infinity norm), so every rank gets the
    same total and scales its gradients by ``max_norm / total`` when the total
    is larger: the result of ``torch.nn.utils.clip_grad_norm_`` on the
    unsplit model. ``counted`` (by default all of ``parameters``) are those
    whose gradients count in the norm: leave out copies of a tied parameter
    that another rank counts. A NaN gradient on any rank makes the total NaN,
    as in torch. ``device`` is where a rank without gradients puts its share
    of the all-reduce (the backend's device); by default its parameters'.
    A failed all-reduce raises a :class:`~stagewise.comm.CommError` naming it
    (and ``timeout``, the group's bound in seconds, when given).
    """
    if not max_norm >= 0:
        raise ValueError(f"max_norm must be >= 0 (0 zeroes the gradients, as in torch), got {max_norm}")
    p = float(norm_type)
    if not (p > 0 or math.isinf(p)):
        raise ValueError(f"norm_type must be positive or inf, got {norm_type}")
    params = list(parameters)  # read twice: once for the norm, once to scale
    grads = [q.grad for q in (params if counted is None else counted) if q.grad is not None]
    if grads:
        device = grads[0].device
    elif device is None:
        device = next((q.device for q in params), torch.device("cpu"))
    dtype = grads[0].dtype if grads else torch.float32  # the norm's, as torch returns it: float64 gradients stay so
    local = (get_total_norm(grads, p) if grads else torch.zeros(())).to(device, torch.float64)
    if math.isinf(p):
        # A max drops NaN or keeps it depending on the order of its operands (gloo's std::max, NCCL's fmax):
        # whether any rank has one travels as a flag of its own.
        pair = torch.stack([local, torch.isnan(local).to(torch.float64)])
        _all_reduce(pair, dist.ReduceOp.MAX, group, timeout)
        total = torch.where(pair[1] > 0, torch.full_like(pair[0], math.nan), pair[0])
    else:
        power = local**p
        _all_reduce(power, dist.ReduceOp.SUM, group, timeout)
        total = power ** (1.0 / p)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(
            f"the total norm of order {norm_type} of the gradients is {float(total)}, so they cannot be clipped; "
            "set error_if_nonfinite=False to clip anyway"
        )
    with_grads = [q for q in params if q.grad is not None]
    if with_grads:
        clip_grads_with_norm_(with_grads, max_norm, total.to(dtype))
    return total.to(dtype)


def _all_reduce(tensor: torch.Tensor, op: Any, group: dist.ProcessGroup, timeout: float | None) -> None:
    rank = dist.get_rank()
    peer = next((r for r in dist.get_process_group_ranks(group) if r != rank), rank)
    with named_collective(rank=rank, peer=peer, what="the all-reduce of the gradients' norm", timeout=timeout):
        dist.all_reduce(tensor, op=op, group=group)
