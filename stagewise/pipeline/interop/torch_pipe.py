"""A stagewise Partition under torch.distributed.pipelining's runtime: a traced Pipe, or a chain's stages directly.

A traced ``Pipe`` cut where the partition cuts (:func:`torch_pipe`), or a chain's stages built directly
(:func:`torch_stages`) and run by a stagewise schedule (:func:`torch_runtime`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

if TYPE_CHECKING:  # importing torch.distributed.pipelining takes a second and a half (dynamo, DTensor)
    from torch.distributed.pipelining import Pipe, PipelineStage
    from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime

from stagewise.partition import CapturedChain, Partition, layers_of
from stagewise.pipeline.interop.torch_schedules import to_torch
from stagewise.schedule import Schedule


def torch_pipe(model: nn.Module, partition: Partition, mb_args: tuple[Any, ...]) -> Pipe:
    """torch's ``Pipe`` of ``model`` with a stage boundary wherever ``partition`` has one.

    ``model`` is a chain (see :func:`stagewise.partition.layers_of`) or a
    :class:`~stagewise.partition.CapturedChain`, whose source model torch traces
    again. The boundaries come from :meth:`Partition.split_spec`; they are put
    in with forward pre-hooks that call ``pipe_split()``, removed afterwards,
    so the model is left as it was (``pipeline(model, split_spec=...)`` wraps
    the modules' ``forward`` for good). From the Pipe, torch's own API runs
    the same stages under its schedule classes::

        pipe = torch_pipe(chain, part, mb_args=(ids[:mb], mask[:mb]))
        stage = pipe.build_stage(rank, device, group)
        schedule = torch.distributed.pipelining.Schedule1F1B(stage, n_microbatches, loss_fn=loss_fn)
        schedule.step(ids, mask) on the first stage; schedule.step(target=y, losses=losses) on the last

    torch traces with the static shapes of ``mb_args``: every micro-batch must have them.
    """
    from torch.distributed.pipelining import SplitPoint, pipeline

    spec = partition.split_spec(model)
    source = model.source.model if isinstance(model, CapturedChain) else model
    handles = []
    for name, point in spec.items():
        if point is not SplitPoint.BEGINNING:  # split_spec only makes BEGINNING points
            raise ValueError(f"unexpected split point {point} for {name!r}")
        handles.append(source.get_submodule(name).register_forward_pre_hook(_split_here))
    try:
        return pipeline(source, mb_args)
    finally:
        for handle in handles:
            handle.remove()


def _split_here(module: nn.Module, inputs: object) -> None:
    from torch.distributed.pipelining import pipe_split

    pipe_split()  # type: ignore[no-untyped-call]


def torch_stages(
    model: nn.Module,
    partition: Partition,
    schedule: Schedule,
    rank: int,
    *,
    device: torch.device | None = None,
    group: dist.ProcessGroup | None = None,
) -> list[PipelineStage]:
    """torch's ``PipelineStage`` for each stage that ``schedule`` gives ``rank``: the chain ``model``'s layers
    between ``partition``'s bounds, as an ``nn.Sequential`` of the model's own modules (no tracing, no copy).
    torch infers the shapes between stages at the first step."""
    from torch.distributed.pipelining import PipelineStage

    layers = layers_of(model)
    if partition.n_layers != len(layers) or partition.n_stages != schedule.n_stages:
        raise ValueError(
            f"the partition has {partition.n_stages} stages of {partition.n_layers} layers, the schedule "
            f"{schedule.n_stages} stages and the model {len(layers)} layers; partition this model for this schedule"
        )
    bounds = partition.bounds
    return [
        PipelineStage(
            nn.Sequential(*(layer.module for layer in layers[bounds[s] : bounds[s + 1]])),
            s,
            schedule.n_stages,
            device or torch.device("cpu"),
            group=group,
        )
        for s in schedule.stages_of(rank)
    ]


def torch_runtime(
    stages: list[PipelineStage], schedule: Schedule, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
) -> _PipelineScheduleRuntime:
    """torch's schedule runtime for this rank's ``stages``, running ``schedule`` exported by :func:`to_torch` (torch
    adds the sends and receives and reads the placement from the actions). ``step(inputs, target=..., losses=...)``
    on the ranks of the first and last stage, ``step()`` elsewhere, as with torch's own schedules. Relies on torch's
    private ``_PipelineScheduleRuntime`` and its ``_prepare_schedule_with_comms``, the entry for custom schedules."""
    from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime

    runtime = _PipelineScheduleRuntime(stages, schedule.n_microbatches, loss_fn=loss_fn)  # type: ignore[no-untyped-call]
    runtime._prepare_schedule_with_comms(to_torch(schedule))
    return runtime
