"""What a rank of a layout holds: its parameter state, one micro-batch's working bytes, its activations."""

from __future__ import annotations

from collections.abc import Sequence

from stagewise.partition import LayerCost, MemoryModel
from stagewise.schedule import Schedule


def state_multiplier(multiplier: float, fsdp: int) -> float:
    """Copies of each parameter a rank holds at its fullest: without FSDP, ``multiplier`` (weights, gradients,
    optimizer state); with it, ``1/fsdp`` of those plus, during the step, the whole parameters and gradients."""
    return multiplier if fsdp == 1 else 2 + multiplier / fsdp


def working(costs: Sequence[LayerCost], layers: Sequence[int], recompute: float, loss: float) -> float:
    """Bytes a stage of ``layers`` holds on top of its memory model while it computes one micro-batch: the most
    that one of its layers holds for a moment (:attr:`LayerCost.working_bytes`) or, on the last stage, the loss;
    with activation checkpointing also the layer it recomputes."""
    return recompute + max([loss, *(costs[i].working_bytes for i in layers)])


def rank_activation(
    memory: MemoryModel,
    schedule: Schedule,
    costs: Sequence[LayerCost],
    stages: Sequence[range],
    recompute: float,
    loss_extra: float,
) -> list[float]:
    """Per rank: the bytes its stages hold for backward at their fullest (micro-batches in flight and pooled weight
    gradients) plus the most that computing one micro-batch holds on top (``recompute`` bytes of a recomputed
    layer, ``loss_extra`` of the loss on the last stage)."""
    last = len(stages) - 1
    return [
        sum(memory.stage_bytes(s, stages[s].start, stages[s].stop) - memory.fixed_bytes(stages[s]) for s in mine)
        + max(  # a rank computes one micro-batch at a time
            working(costs, stages[s], recompute, loss_extra if s == last else 0.0) for s in mine
        )
        for mine in (schedule.stages_of(r) for r in range(schedule.n_ranks))
    ]
