"""Tensor parallelism's costs on one of a layout's ``tp`` ranks: what a split layer keeps, and its collectives."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from stagewise.partition import LayerCost
from stagewise.partition.layers import SharedParameter
from stagewise.plan.cluster import Cluster
from stagewise.plan.tensor_traffic import LayerTraffic
from stagewise.plan.time_model import ring_seconds

REPLICATED_ACTIVATIONS = 0.25
"""The share of a split layer's saved activations that every ``tp`` rank keeps whole: in a GPT block, the residual
stream and the layer norms' inputs and outputs, 4 of the 17 activations of ``d`` values per token it saves (the
attention's q, k, v and output and the MLP's hidden units split). An approximation for other plans."""


def split_costs(costs: list[LayerCost], traffic: Sequence[LayerTraffic] | None, tp: int) -> list[LayerCost]:
    """Costs on one of ``tp`` ranks: a split layer's parameters, FLOPs and time divide by ``tp``, its saved
    activations but :data:`REPLICATED_ACTIVATIONS` of them too; its output stays whole."""
    if traffic is None:
        return costs
    kept = REPLICATED_ACTIVATIONS + (1 - REPLICATED_ACTIVATIONS) / tp
    out = []
    for c, t in zip(costs, traffic, strict=True):
        if not t.split:
            out.append(c)
            continue
        out.append(
            dataclasses.replace(
                c,
                params=c.params // tp,
                param_bytes=c.param_bytes // tp,
                flops=c.flops // tp,
                forward_flops=c.forward_flops // tp,
                time=None if c.time is None else c.time / tp,
                saved_bytes=int(c.saved_bytes * kept),
                working_bytes=int(c.working_bytes * kept),
                selective_bytes=int(c.selective_bytes * kept),
                recompute_flops=c.recompute_flops // tp,
                recompute_bytes=int(c.recompute_bytes * kept),
                checkpoint_flops=None if c.checkpoint_flops is None else c.checkpoint_flops // tp,
                recompute_time=None if c.recompute_time is None else c.recompute_time * kept,
            )
        )
    return out


def collective_seconds(
    costs: Sequence[LayerCost], traffic: Sequence[LayerTraffic] | None, tp: int, cluster: Cluster, input_bytes: float
) -> list[tuple[float, float]]:
    """Per layer: the seconds of its tensor-parallel collectives in one micro-batch's forward and backward."""
    if traffic is None:
        return [(0.0, 0.0)] * len(costs)
    bandwidth, latency = cluster.intra_node_bandwidth, cluster.link_latency
    out = []
    previous = input_bytes
    for c, t in zip(costs, traffic, strict=True):
        reduce_out = ring_seconds(c.output_bytes, tp, bandwidth, latency, all_reduce=True)
        gather_out = ring_seconds(c.output_bytes, tp, bandwidth, latency, all_reduce=False)
        reduce_in = ring_seconds(previous, tp, bandwidth, latency, all_reduce=True)
        forward = t.forward_all_reduces * reduce_out + t.forward_all_gathers * gather_out
        out.append((forward, t.backward_all_reduces * reduce_in))
        previous = c.output_bytes
    return out


def split_ties(
    shared: Sequence[SharedParameter], traffic: Sequence[LayerTraffic] | None, tp: int
) -> tuple[SharedParameter, ...]:
    """The tied parameters as one rank holds them: ``1/tp`` of one whose layers all split (a GPT's vocabulary)."""
    if traffic is None:
        return tuple(shared)
    return tuple(
        dataclasses.replace(tie, nbytes=tie.nbytes // tp) if all(traffic[i].split for i in tie.indices) else tie
        for tie in shared
    )
