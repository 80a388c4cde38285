"""checked_schedule(): Pipeline's arguments checked before any process group, and the schedule they ask for."""

from __future__ import annotations

from collections.abc import Sequence

from stagewise.partition import Layer, Partition
from stagewise.pipeline.data_parallel import DataParallel
from stagewise.pipeline.executor import LossFn
from stagewise.pipeline.fusion import WeightGradientFusion
from stagewise.pipeline.microbatch import LossReduction
from stagewise.schedule.actions import Schedule
from stagewise.schedule.builders import ScheduleName, build
from stagewise.schedule.validate import validate


def checked_schedule(
    layers: Sequence[Layer],
    partition: Partition,
    schedule: ScheduleName | Schedule,
    n_microbatches: int,
    *,
    n_virtual: int,
    loss_fn: LossFn,
    activation_checkpointing: bool,
    loss_reduction: LossReduction,
    fuse_weight_gradients: WeightGradientFusion | None,
    nonfinite: str,
    data_parallel: DataParallel | None,
) -> Schedule:
    """The validated schedule of a :class:`~stagewise.Pipeline` over ``layers``; its other arguments checked.

    Raises:
        TypeError: an argument of the wrong type (the message names it and what to pass).
        ValueError: a value that cannot run, or two that do not go together.
    """
    if not isinstance(partition, Partition):
        raise TypeError(f"partition must be a stagewise Partition, got {type(partition).__name__}")
    if loss_reduction not in ("mean", "sum"):
        raise ValueError(f"loss_reduction must be 'mean' or 'sum', got {loss_reduction!r}")
    if nonfinite not in ("raise", "skip"):
        raise ValueError(f"nonfinite must be 'raise' or 'skip', got {nonfinite!r}")
    if fuse_weight_gradients is not None and not isinstance(fuse_weight_gradients, WeightGradientFusion):
        raise TypeError(
            f"fuse_weight_gradients must be a WeightGradientFusion or None, got {fuse_weight_gradients!r}; "
            "e.g. WeightGradientFusion.every() to fuse every linear weight, or None to leave gradient "
            "accumulation to autograd"
        )
    if data_parallel is not None and not isinstance(data_parallel, DataParallel):
        raise TypeError(f"data_parallel must be a stagewise DataParallel, got {type(data_parallel).__name__}")
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}")
    if partition.n_layers != len(layers):
        raise ValueError(
            f"the partition splits {partition.n_layers} layers but the model has {len(layers)}; "
            "partition this model's layers (stagewise.partition.auto or balance)"
        )
    if isinstance(schedule, Schedule):
        plan = schedule
        if plan.n_stages != partition.n_stages or plan.n_microbatches != n_microbatches:
            raise ValueError(
                f"the schedule is for {plan.n_stages} stages and {plan.n_microbatches} micro-batches, but the "
                f"partition has {partition.n_stages} stages and n_microbatches is {n_microbatches}"
            )
    else:
        plan = build(schedule, partition.n_stages, n_microbatches, n_virtual=n_virtual)
    validate(plan)
    if activation_checkpointing and plan.splits_backward:
        raise ValueError(
            "activation checkpointing and split backward (zero-bubble) do not combine: W would recompute "
            "every layer's forward a second time; choose one"
        )
    return plan
