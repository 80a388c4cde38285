"""auto(): profile a chain, model its memory under a schedule, and balance it in one call."""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Sequence
from typing import Literal, get_args

import torch
from torch import nn

from stagewise.partition.balance import Weights, balance
from stagewise.partition.call_spec import Inputs
from stagewise.partition.layer_cost import LayerCost
from stagewise.partition.layers import Layer, SharedParameter, layers_of, shared_parameters
from stagewise.partition.memory import MemorySetting
from stagewise.partition.profile import profile
from stagewise.partition.shared_cost import Tie
from stagewise.partition.split import Partition
from stagewise.schedule import build

By = Literal["time", "flops", "params", "memory"]
"""What a stage's load counts: measured time, FLOPs, parameters, or bytes of memory."""


def balance_costs(
    costs: Sequence[LayerCost],
    n_stages: int,
    *,
    by: By = "flops",
    speeds: Weights | None = None,
    capacities: Weights | None = None,
    memory: MemorySetting | None = None,
    n_microbatches: int | None = None,
    shared: Sequence[SharedParameter] = (),
) -> Partition:
    """Balance profiled layers by ``by``, within ``capacities`` under ``memory``'s schedule.

    The memory of each stage follows :func:`memory_model` under ``memory``
    (a :class:`MemorySetting`): parameter state (``state_multiplier`` copies
    of the weights) plus buffers, plus saved activations times the
    micro-batches in flight on that stage as its schedule runs them, plus the
    pooled weight gradients of its ``holdings``. For example
    ``memory=MemorySetting(schedule, holdings(schedule))`` with ``schedule =
    build("zero-bubble", n_stages, 8)`` counts what ``Pipeline`` holds by
    default. ``n_microbatches`` alone is short for
    ``MemorySetting(build("1f1b", n_stages, n_microbatches))``; with neither,
    each stage holds one micro-batch. ``shared`` lists the parameters layers share
    (:func:`~stagewise.partition.shared_parameters`): a stage holding several
    of their layers keeps, and counts, one copy.
    """
    if by not in get_args(By):
        raise ValueError(f"unknown balance criterion by={by!r}; choose one of {list(get_args(By))}")
    if not costs:
        raise ValueError("there are no layer costs to balance")
    model = _setting(memory, n_stages, n_microbatches).model(costs, n_stages, shared)
    part = balance(
        model if by == "memory" else _weights(costs, by),
        n_stages,
        speeds=speeds,
        memory=model,
        capacities=capacities,
        names=[c.name for c in costs],
        ties=[Tie(tie.indices, float(tie.numel)) for tie in shared] if by == "params" else (),
    )
    b = part.bounds
    params = tuple(params_of(costs, shared, range(b[s], b[s + 1])) for s in range(part.n_stages))
    return dataclasses.replace(part, params=params)


def _setting(memory: MemorySetting | None, n_stages: int, n_microbatches: int | None) -> MemorySetting:
    """``memory``, or the 1F1B setting that ``n_microbatches`` is short for; never both."""
    if n_microbatches is None:
        return MemorySetting() if memory is None else memory
    if memory is not None and memory.schedule is not None:
        raise ValueError(
            f"n_microbatches={n_microbatches} is short for a 1F1B schedule, but memory already has its schedule "
            f"({memory.schedule.name!r}, {memory.schedule.n_microbatches} micro-batches); give one of them"
        )
    schedule = build("1f1b", n_stages, n_microbatches)
    return MemorySetting(schedule) if memory is None else dataclasses.replace(memory, schedule=schedule)


def _weights(costs: Sequence[LayerCost], by: By) -> list[float]:
    """Per layer: what ``by`` counts of its load (``by="memory"`` is the memory model instead)."""
    if by == "time":
        missing = [c.name for c in costs if c.time is None]
        if missing:
            raise ValueError(
                f"by='time' needs measured times, but {len(missing)} layers have none (first: {missing[0]!r}); "
                "profile with time=True, or balance by 'flops'"
            )
        return [float(c.time or 0.0) for c in costs]
    if by == "params":
        return [float(c.params) for c in costs]
    return [float(c.flops) for c in costs]


def params_of(
    costs: Sequence[LayerCost], shared: Sequence[SharedParameter], layers: Collection[int], *, nbytes: bool = False
) -> int:
    """Parameters (elements, or bytes with ``nbytes``) of ``layers`` (indices: a stage's ``range(start, stop)``, or
    a rank's stages together), each shared one counted once."""
    ties = [Tie(tie.indices, tie.nbytes if nbytes else tie.numel) for tie in shared]
    repeats = sum(tie.repeated(layers) for tie in ties)
    return sum(costs[i].param_bytes if nbytes else costs[i].params for i in layers) - int(repeats)


def auto(
    model: nn.Module | Sequence[Layer],
    n_stages: int,
    sample: Inputs,
    *,
    by: By = "flops",
    speeds: Weights | None = None,
    capacities: Weights | None = None,
    memory: MemorySetting | None = None,
    device: torch.device | str | None = None,
) -> Partition:
    """Profile ``model`` on one micro-batch ``sample`` and return the optimal partition.

    ``by="time"`` measures each layer on ``device`` (see :func:`profile`); the
    other criteria work on the meta device. ``memory`` says what each stage
    holds under which schedule, e.g. ``MemorySetting(build("1f1b",
    n_stages, 16))``; see :func:`balance_costs`.
    """
    if by not in get_args(By):
        raise ValueError(f"unknown balance criterion by={by!r}; choose one of {list(get_args(By))}")
    costs = profile(model, sample, time=by == "time", device=device)
    layers = layers_of(model) if isinstance(model, nn.Module) else list(model)
    return balance_costs(
        costs,
        n_stages,
        by=by,
        speeds=speeds,
        capacities=capacities,
        memory=memory,
        shared=shared_parameters(layers),
    )
