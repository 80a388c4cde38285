"""Gradient clipping by the norm of the whole model's gradients, spread over the ranks of a pipeline."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import _StridedShard  # private: how FSDP shards a TP shard again
from torch.nn.utils import clip_grads_with_norm_, get_total_norm

from stagewise.comm.errors import named_collective


@dataclass(frozen=True)
class Counting:
    """Which gradients count in the total norm, and how many ranks hold each."""

    counted: Iterable[nn.Parameter] | None = None
    """The parameters whose gradients count (None: all those passed): leave out copies of a tied parameter that
    another rank counts."""
    copies: Callable[[torch.Tensor], int] | None = None
    """How many ranks of the group hold the same part of a gradient as this one (replicas, or the ``tp`` ranks
    of a parameter left whole, see :func:`held_copies`): each rank's ``norm ** p`` of it is divided by that, so
    each element counts once in the sum (a max needs no such care). None: this rank alone."""


def clip_grad_norm_(
    parameters: Iterable[nn.Parameter],
    max_norm: float,
    norm_type: float = 2.0,
    *,
    group: dist.ProcessGroup,
    counting: Counting | None = None,
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
    unsplit model. ``counting`` says which gradients count in the norm, and
    how many ranks hold each (see :class:`Counting`); by default all of
    ``parameters``, each held by this rank alone. A NaN gradient on any rank makes the total NaN,
    as in torch. ``device`` is where the all-reduce runs (the backend's device:
    gradients offloaded to host memory are summed there); by default the
    gradients' (the parameters' on a rank without gradients).
    A failed all-reduce raises a :class:`~stagewise.comm.CommError` naming it
    (and ``timeout``, the group's bound in seconds, when given).

    Sharded gradients (DTensors, under FSDP or tensor parallelism) count by
    their local shards.
    """
    if not max_norm >= 0:
        raise ValueError(f"max_norm must be >= 0 (0 zeroes the gradients, as in torch), got {max_norm}")
    p = float(norm_type)
    if not (p > 0 or math.isinf(p)):
        raise ValueError(f"norm_type must be positive or inf, got {norm_type}")
    params = list(parameters)  # read twice: once for the norm, once to scale
    counted = params if counting is None or counting.counted is None else list(counting.counted)
    copies = counting.copies if counting is not None else None
    grads = [q.grad for q in counted if q.grad is not None]
    if device is None:  # the backend's device, where gradients offloaded to host memory are not
        device = grads[0].device if grads else next((q.device for q in params), torch.device("cpu"))
    dtype = grads[0].dtype if grads else torch.float32  # the norm's, as torch returns it: float64 gradients stay so
    local = _local_norm(grads, p, copies, device)
    if math.isinf(p):
        # A max drops NaN or keeps it depending on the order of its operands (gloo's std::max, NCCL's fmax):
        # whether any rank has one travels as a flag of its own.
        pair = torch.stack([local, torch.isnan(local).to(torch.float64)])
        _all_reduce(pair, dist.ReduceOp.MAX, group, timeout)
        total = torch.where(pair[1] > 0, torch.full_like(pair[0], math.nan), pair[0])
    else:
        power = local if copies is not None else local**p  # _local_norm gives the weighted power already
        _all_reduce(power, dist.ReduceOp.SUM, group, timeout)
        total = power ** (1.0 / p)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(
            f"the total norm of order {norm_type} of the gradients is {float(total)}, so they cannot be clipped; "
            "set error_if_nonfinite=False to clip anyway"
        )
    with_grads = [q for q in params if q.grad is not None]
    whole = [q for q in with_grads if not isinstance(q.grad, DTensor)]
    if whole:
        clip_grads_with_norm_(whole, max_norm, total.to(dtype))
    sharded = [q.grad.to_local() for q in with_grads if isinstance(q.grad, DTensor)]
    if sharded:  # as clip_grads_with_norm_ scales, on each local shard
        coefficient = torch.clamp(max_norm / (total.to(dtype) + 1e-6), max=1.0)
        for grad in sharded:
            grad.mul_(coefficient.to(grad.device, grad.dtype))
    return total.to(dtype)


def _local_norm(
    grads: list[torch.Tensor], p: float, copies: Callable[[torch.Tensor], int] | None, device: torch.device
) -> torch.Tensor:
    """This rank's share of the total: the norm of its gradients (of their local shards), or with ``copies``
    the sum of each gradient's ``norm ** p`` over the ranks holding it (for a max: the max, as it is)."""
    if not grads:
        return torch.zeros((), device=device, dtype=torch.float64)
    locals_ = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
    if copies is None or math.isinf(p):
        return get_total_norm(locals_, p).to(device, torch.float64)
    by_copies: dict[int, list[torch.Tensor]] = {}
    for grad, mine in zip(grads, locals_, strict=True):
        by_copies.setdefault(copies(grad), []).append(mine)
    total = torch.zeros((), device=device, dtype=torch.float64)
    for count, group in by_copies.items():
        total += get_total_norm(group, p).to(device, torch.float64) ** p / count
    return total


def held_copies(grad: torch.Tensor, ranks_per_stage: int) -> int:
    """How many of a stage's ``ranks_per_stage`` ranks (``dp x fsdp x tp``) hold the same part of ``grad`` as
    this one: all of them for a whole tensor, fewer by the size of each mesh dimension a DTensor is sharded on."""
    shards = 1
    if isinstance(grad, DTensor):
        for size, placement in zip(grad.device_mesh.shape, grad.placements, strict=True):
            if placement.is_shard() or isinstance(placement, _StridedShard):  # FSDP's over tensor parallelism's
                shards *= size
    return ranks_per_stage // shards


def _all_reduce(tensor: torch.Tensor, op: Any, group: dist.ProcessGroup, timeout: float | None) -> None:
    rank = dist.get_rank()
    peer = next((r for r in dist.get_process_group_ranks(group) if r != rank), rank)
    with named_collective(rank=rank, peer=peer, what="the all-reduce of the gradients' norm", timeout=timeout):
        dist.all_reduce(tensor, op=op, group=group)
