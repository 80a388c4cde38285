"""What the routed experts of a mixture-of-experts layer cost: per layer for one profiled micro-batch, and on one
rank of a layout with ``ep`` expert-parallel ranks.

Expert parallelism (:attr:`stagewise.comm.Layout.ep`) splits each MoE layer's routed experts over ``ep``
consecutive data ranks of a stage: a rank holds ``experts / ep`` of them whole, with their gradients and optimizer
state; FSDP does not shard them and tensor parallelism does not split them. On average a rank's experts receive as
many token choices as its own tokens make (``tokens * top_k``), so their compute does not shrink with ``ep``; the
busiest rank's exceeds the mean by the workload's :attr:`~stagewise.plan.workload.Workload.expert_imbalance`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from torch import nn

from stagewise.models.moe import moe_layers
from stagewise.partition import LayerCost, layers_of
from stagewise.plan.balanced_moe import Routed

SWIGLU_MATMULS = 3
"""Matmuls of a SwiGLU expert: gate, up and down, each ``2 * width * hidden`` FLOPs per token."""
SAVED_PER_CHOICE = 4
"""Tensors of an expert's hidden width it saves per token choice for backward: the gate's output, its SiLU, the up
projection's output and their product (beside the choice's input, and its output that the combine keeps)."""


@dataclass(frozen=True)
class ExpertCost:
    """The routed experts of one layer's MoE modules, for one profiled micro-batch under balanced routing."""

    experts: int
    """Routed experts per MoE module (the fewest, where the layer holds several)."""
    top_k: int
    """Experts each token is routed to (the fewest, where the layer holds several MoE modules)."""
    params: int
    """Parameter elements of every routed expert (all of them, not only the active)."""
    param_bytes: int
    flops: int
    """Forward plus backward FLOPs of the routed experts on the micro-batch's token choices (the backward twice
    the forward: gradients of the inputs and of the weights)."""
    forward_flops: int
    saved_bytes: int
    """Bytes the routed experts save for backward: each choice's input and output and
    :data:`SAVED_PER_CHOICE` hidden-width tensors."""
    selective_bytes: int
    """Of :attr:`saved_bytes`, what selective checkpointing keeps: the outputs of the gate, up and down matmuls."""
    dispatch_bytes: int
    """Bytes of the token choices one all-to-all of the layer moves, summed over its MoE modules:
    ``tokens * top_k * width`` elements (the dispatch sends each choice; the combine sends its output back)."""
    modules: int = 1
    """MoE modules in the layer: each runs 2 all-to-alls in its forward and 2 in its backward."""


def expert_cost(routed: Sequence[Routed], params: int, param_bytes: int) -> ExpertCost:
    """The :class:`ExpertCost` of a layer whose MoE modules routed ``routed`` (balanced) and whose routed experts
    hold ``params`` elements of ``param_bytes`` bytes."""
    forward = sum(2 * SWIGLU_MATMULS * r.kept * r.width * r.hidden for r in routed)
    return ExpertCost(
        experts=min(r.config.experts for r in routed),
        top_k=min(r.config.top_k for r in routed),
        params=params,
        param_bytes=param_bytes,
        flops=3 * forward,
        forward_flops=forward,
        saved_bytes=sum(r.kept * (2 * r.width + SAVED_PER_CHOICE * r.hidden) * r.element_bytes for r in routed),
        selective_bytes=sum(r.kept * (r.width + 2 * r.hidden) * r.element_bytes for r in routed),
        dispatch_bytes=sum(r.tokens * r.config.top_k * r.width * r.element_bytes for r in routed),
        modules=len(routed),
    )


def layer_expert_costs(model: nn.Module, routed: Sequence[Routed]) -> tuple[ExpertCost | None, ...]:
    """Per layer of ``model`` (:func:`~stagewise.partition.layers_of`): the :class:`ExpertCost` of its MoE modules,
    which routed ``routed`` in a balanced forward (:func:`~stagewise.plan.balanced_moe.balanced_routing`), or None
    for a layer without any; empty where no layer has one."""
    out: list[ExpertCost | None] = []
    for index, layer in enumerate(layers_of(model)):
        mine = [r for r in routed if r.layer == index and r.tokens]
        if not mine:
            out.append(None)
            continue
        weights = [p for moe in moe_layers(layer.module) for p in moe.experts.parameters()]
        nbytes = sum(p.numel() * p.element_size() for p in weights)
        out.append(expert_cost(mine, sum(p.numel() for p in weights), nbytes))
    return tuple(out) if any(c is not None for c in out) else ()


def imbalance_on(ep: int, imbalance: float) -> float:
    """How much more than the mean the busiest of ``ep`` expert-parallel ranks computes and receives: ``imbalance``
    where the experts are split (``ep > 1``), 1 where every rank holds them all (its own tokens' choices are all
    it computes, however they fall on its experts)."""
    return imbalance if ep > 1 else 1.0


@dataclass(frozen=True)
class RankExperts:
    """A layer's routed experts on one rank of a layout, at its micro-batch size."""

    param_bytes: float
    """Bytes of the rank's ``1/ep`` share of the experts' parameters."""
    state_bytes: float
    """Bytes the rank holds of them whatever runs: weights, gradients and optimizer state of its share."""
    flops: float
    """Forward plus backward FLOPs on the busiest rank, per micro-batch."""
    forward_flops: float
    saved_bytes: float
    """Bytes the busiest rank's experts save per micro-batch."""
    selective_bytes: float
    """Of those, what selective checkpointing keeps (their matmuls' outputs)."""
    dispatch_bytes: float
    """Bytes one all-to-all moves on the busiest rank per micro-batch (what leaves it and what reaches it)."""
    modules: int


def on_rank(cost: ExpertCost, factor: float, ep: int, imbalance: float, multiplier: float) -> RankExperts:
    """``cost`` (for the profiled micro-batch) on one rank of ``ep`` at ``factor`` times that micro-batch, the
    busiest rank's load ``imbalance`` times the mean (:func:`imbalance_on`), ``multiplier`` copies of each
    parameter kept (weights, gradients, optimizer state)."""
    busiest = imbalance_on(ep, imbalance) * factor
    share = cost.param_bytes / ep
    return RankExperts(
        param_bytes=share,
        state_bytes=share * multiplier,
        flops=cost.flops * busiest,
        forward_flops=cost.forward_flops * busiest,
        saved_bytes=cost.saved_bytes * busiest,
        selective_bytes=cost.selective_bytes * busiest,
        dispatch_bytes=cost.dispatch_bytes * busiest,
        modules=cost.modules,
    )


def _time_scaled(cost: LayerCost, flops: int) -> float | None:
    """``cost``'s measured time, scaled to ``flops`` FLOPs from its own."""
    if cost.time is None:
        return None
    return cost.time * flops / cost.flops if cost.flops else cost.time


def without_experts(cost: LayerCost, experts: ExpertCost) -> LayerCost:
    """``cost`` (as profiled) less its routed ``experts``: what the rest of the layer costs, which FSDP shards and
    tensor parallelism splits."""
    flops = max(0, cost.flops - experts.flops)
    return dataclasses.replace(
        cost,
        params=cost.params - experts.params,
        param_bytes=cost.param_bytes - experts.param_bytes,
        flops=flops,
        forward_flops=max(0, cost.forward_flops - experts.forward_flops),
        saved_bytes=max(0, cost.saved_bytes - experts.saved_bytes),
        selective_bytes=max(0, cost.selective_bytes - experts.selective_bytes),
        checkpoint_flops=None,  # where the experts fall in what checkpointing recomputes is not known: all of it
        recompute_time=None,  # the experts' share of it neither: priced by FLOPs and bytes
        time=_time_scaled(cost, flops),
    )


def with_experts(cost: LayerCost, rank: RankExperts, checkpointing: bool | Literal["selective"]) -> LayerCost:
    """``cost`` (the rest of a layer on a rank, at its micro-batch size and under ``checkpointing``) with the
    rank's experts ``rank`` added back: their state held whatever runs (counted with the buffers, as FSDP does not
    shard it), their compute, and what they save (none under whole-layer checkpointing, which keeps only the
    layer's input; their matmuls' outputs under selective: :data:`stagewise.plan.option.Checkpointing`)."""
    flops = cost.flops + int(rank.flops)
    saved = {False: rank.saved_bytes, True: 0.0, "selective": rank.selective_bytes}[checkpointing]
    return dataclasses.replace(
        cost,
        buffer_bytes=cost.buffer_bytes + int(rank.state_bytes),
        flops=flops,
        forward_flops=cost.forward_flops + int(rank.forward_flops),
        saved_bytes=cost.saved_bytes + int(saved),
        selective_bytes=cost.selective_bytes + int(rank.selective_bytes),
        time=_time_scaled(cost, flops),
    )


def dense_costs(costs: Sequence[LayerCost], experts: Sequence[ExpertCost | None]) -> list[LayerCost]:
    """Layers as profiled (``costs``) less their routed ``experts`` (:func:`without_experts`; none: as they are)."""
    if not experts:
        return list(costs)
    return [c if e is None else without_experts(c, e) for c, e in zip(costs, experts, strict=True)]


def rank_experts(
    experts: Sequence[ExpertCost | None], n_layers: int, factor: float, ep: int, imbalance: float, multiplier: float
) -> list[RankExperts | None]:
    """Per layer of ``n_layers``: its routed ``experts`` on the busiest of ``ep`` ranks at ``factor`` times the
    profiled micro-batch (:func:`on_rank`), or None for a layer without any."""
    if not experts:
        return [None] * n_layers
    return [None if e is None else on_rank(e, factor, ep, imbalance, multiplier) for e in experts]
