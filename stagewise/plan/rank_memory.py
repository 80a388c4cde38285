"""What a rank of a layout holds: its parameter state, one micro-batch's working bytes, its activations."""

from __future__ import annotations

from collections.abc import Sequence

from stagewise.partition import LayerCost, MemoryModel
from stagewise.plan.option import Option
from stagewise.schedule import Schedule
from stagewise.schedule.holdings import Holding

OFFLOADED_IN_FLIGHT = 2
"""Micro-batches of a stage whose saved activations stay on the device with activation offloading: the one its
action computes (sent to the host as it goes) and the one brought back ahead of the next backward."""


def whole_copies(option: Option) -> float:
    """Whole (unsharded) copies of each parameter of a rank's stages that a rank with FSDP holds amid its
    activations.

    Gathered once a step (``fsdp_gather="step"``): the whole parameters and the whole gradients of every stage,
    2 (:func:`end_copies` for the reduce-scatter at the step's end). Gathered per action (``"micro-batch"``): the
    whole parameters of the stage at work and, after a backward, its whole gradients and their reduce-scatter's
    input (the stage is freed after it, and the next stage's gather issued then); over ``v`` stages per rank,
    ``3 / v`` per parameter (with one stage per rank, more than once a step, amid the activations).
    """
    if option.fsdp_gather == "step":
        return 2.0
    return 3 / option.n_virtual


def end_copies(option: Option) -> float:
    """Whole copies of each parameter a rank with FSDP gathered once a step holds as the step ends, its
    activations gone: the whole parameters and gradients, and the reduce-scatter's input, a copy of the gradients
    (3); 0 where the gradients are reduce-scattered per action, amid the activations (:func:`whole_copies`)."""
    return 3.0 if option.fsdp > 1 and option.fsdp_gather == "step" else 0.0


def state_multiplier(multiplier: float, option: Option) -> float:
    """Copies of each parameter a rank holds on its device amid its activations: without FSDP, ``multiplier``
    (weights, gradients, optimizer state); with it, ``1/fsdp`` of those plus the whole parameters and gradients it
    gathers (:func:`whole_copies`), the sharded gradients left out where they are made at the step's end (once a
    step: ``zero_grad`` left none). With the optimizer offloaded (FSDP2's CPU offload, ``fsdp >= 1``) the sharded
    state lives on the host: only the whole copies stay."""
    if option.offload_optimizer:
        return whole_copies(option)
    if option.fsdp == 1:
        return multiplier
    sharded = multiplier - 1 if option.fsdp_gather == "step" else multiplier
    return whole_copies(option) + sharded / option.fsdp


def end_multiplier(multiplier: float, option: Option) -> float:
    """Copies of each parameter a rank holds on its device as a step gathered once ends (:func:`end_copies`, with
    the sharded state but its gradients); 0 where that moment is not apart from the activations."""
    copies = end_copies(option)
    if not copies or option.offload_optimizer:
        return copies
    return copies + (multiplier - 1) / option.fsdp


def host_multiplier(multiplier: float, option: Option) -> float:
    """Copies of each parameter a rank keeps in host memory: with the optimizer offloaded, its ``1/fsdp`` share
    of the weights, gradients and optimizer state; else none."""
    return multiplier / option.fsdp if option.offload_optimizer else 0.0


def offloaded(moments: tuple[tuple[Holding, ...], ...]) -> tuple[tuple[Holding, ...], ...]:
    """Holdings with activation offloading: each moment holds at most :data:`OFFLOADED_IN_FLIGHT` micro-batches'
    saved activations on the device (the rest are on the host); output gradients waiting for W stay."""
    return tuple(tuple(Holding(min(h.in_flight, OFFLOADED_IN_FLIGHT), h.pooled) for h in stage) for stage in moments)


def working(costs: Sequence[LayerCost], layers: Sequence[int], recompute: float, loss: float) -> float:
    """Bytes a stage of ``layers`` holds on top of its memory model while it computes one micro-batch: the most
    that one of its layers holds for a moment (:attr:`LayerCost.working_bytes`) or, on the last stage, the loss;
    with activation checkpointing also the layer it recomputes."""
    return recompute + max([loss, *(costs[i].working_bytes for i in layers)])


def flush_bytes(
    memory: MemoryModel, schedule: Schedule, costs: Sequence[LayerCost], stage: int, layers: range
) -> float:
    """Bytes a stage's weight-gradient pool holds on top of its pooled tensors while it flushes: each weight's
    gradient is one GEMM over the concatenation of its pooled output gradients and inputs (``torch.cat`` over the
    ``k`` backwards the pool holds), one weight after another, the previous weight's concatenation alive while
    the next is made. Counted as ``k`` times the most that one of the stage's layers holds so
    (:attr:`LayerCost.flush_bytes`, its two largest pooled linears). 0 where the pool holds one backward
    (nothing is concatenated) or the stage pools nothing (sharded stages; a split backward, whose ``pooled``
    counts micro-batches waiting for W)."""
    if schedule.splits_backward or not memory.pooled:
        return 0.0
    pool = max(h.pooled for h in memory.moments(stage))
    if pool < 2:
        return 0.0
    return pool * max(costs[i].flush_bytes for i in layers)


def last_working(schedule: Schedule, costs: Sequence[LayerCost], layers: range, recompute: float, loss: float) -> float:
    """:func:`working` of the last stage, computing the loss's ``loss`` bytes: a whole backward (B) frees the
    output-sized tensor the loss saved (counted with the last layer's saved bytes, see
    ``stagewise.plan.setting.scaled``) before any layer's backward runs, so a layer's working bytes count less
    it; a split backward's I keeps the graph, that tensor with it, for W."""
    freed = 0 if schedule.splits_backward else costs[-1].output_bytes
    return recompute + max([loss, *(costs[i].working_bytes - freed for i in layers)])


def loss_working(memory: MemoryModel, schedule: Schedule, costs: Sequence[LayerCost], loss_extra: float) -> float:
    """What the loss holds while it runs on the last stage beyond its saved bytes (``loss_extra``), less what
    the stage's fullest moment counts already: with a split backward, the gradient the loss makes of the model's
    output is the last layer's output gradient, which I keeps for W (:func:`~stagewise.partition.memory.
    split_waiting_bytes`), counted with the micro-batches waiting for W from the moment that I ends."""
    if not schedule.splits_backward or not memory.pooled or memory.pooled[-1] < costs[-1].output_bytes:
        return loss_extra
    return max(0.0, loss_extra - costs[-1].output_bytes)


def flushing_bytes(memory: MemoryModel, stage: int, layers: range) -> float:
    """Bytes a stage's weight-gradient pool flushes from: the stage's activations at its moments whose pool is
    full (the backward that fills it flushes it), the fullest of those."""
    moments = memory.moments(stage)
    pool = max(h.pooled for h in moments)
    kept = memory.kept(layers.start, layers.stop)
    pooled = sum(memory.pooled[layers.start : layers.stop]) if memory.pooled else 0.0
    return max(h.in_flight * kept + h.pooled * pooled for h in moments if h.pooled == pool)


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
    layer, ``loss_extra`` of the loss on the last stage, :func:`loss_working`), or, where more, a stage's bytes as
    its weight-gradient pool flushes (:func:`flushing_bytes`) with the flush's own (:func:`flush_bytes`) and the
    rank's other stages at their fullest."""
    last = len(stages) - 1
    loss = loss_working(memory, schedule, costs, loss_extra)
    out = []
    for mine in (schedule.stages_of(r) for r in range(schedule.n_ranks)):
        held = {s: memory.stage_bytes(s, stages[s].start, stages[s].stop) - memory.fixed_bytes(stages[s]) for s in mine}
        resting = sum(held.values())
        # A rank computes one micro-batch, or flushes one pool, at a time.
        computing = resting + max(
            last_working(schedule, costs, stages[s], recompute, loss)
            if s == last
            else working(costs, stages[s], recompute, 0.0)
            for s in mine
        )
        flushing = [
            resting - held[s] + flushing_bytes(memory, s, stages[s]) + flush
            for s in mine
            if (flush := flush_bytes(memory, schedule, costs, s, stages[s])) > 0
        ]
        out.append(max([computing, *flushing]))
    return out


OPTIMIZER_TEMPORARIES = 1.0
"""Copies of every parameter an AdamW step allocates for a moment with torch's multi-tensor (``foreach``)
implementation, the default on accelerators: the square root of the second moment, for all parameters at once."""

PER_TENSOR_TEMPORARIES = 2.0
"""Copies of one parameter an AdamW step allocates for a moment with torch's per-tensor implementation, the
default on the CPU: the square root of its second moment and that divided by the bias correction, one parameter
after another."""


def optimizer_bytes(params: float, largest: float, multiplier: float) -> float:
    """Bytes an optimizer step allocates for a moment over a rank's ``params`` parameter bytes, ``largest`` of
    them in its largest tensor: for AdamW (``multiplier >= 4``: weights, gradients and two moments) the larger of
    torch's two implementations' temporaries, one copy of every parameter (:data:`OPTIMIZER_TEMPORARIES`) or two
    of its largest (:data:`PER_TENSOR_TEMPORARIES`); none for SGD with momentum (``multiplier`` below 4), which
    steps in place."""
    if multiplier < 4:
        return 0.0
    return max(OPTIMIZER_TEMPORARIES * params, PER_TENSOR_TEMPORARIES * largest)


def step_multiplier(multiplier: float, option: Option) -> float:
    """Copies of each parameter a rank holds on its device while its optimizer steps, its activations gone: its
    ``1/fsdp`` share of the weights, gradients and optimizer state (FSDP's whole copies are freed by then); none
    with the optimizer offloaded (it steps on the host)."""
    if option.offload_optimizer:
        return 0.0
    return multiplier / option.fsdp
