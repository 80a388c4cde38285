"""The planner's time model: each layer's seconds, each stage's per micro-batch, and the step's collectives."""

from __future__ import annotations

from collections.abc import Sequence

from stagewise.partition import LayerCost, MemoryModel, Partition
from stagewise.plan.cluster import Cluster, Device
from stagewise.plan.option import Option
from stagewise.plan.workload import Workload
from stagewise.schedule import Schedule, StageCosts


def ring_seconds(nbytes: float, ranks: int, bandwidth: float, latency: float, *, all_reduce: bool) -> float:
    """A ring all-reduce (or all-gather) of ``nbytes`` over ``ranks``: ``2 (n-1)/n`` (or ``(n-1)/n``) of it on the
    wire at ``bandwidth``, after ``latency``."""
    if ranks == 1:
        return 0.0
    share = (ranks - 1) / ranks * (2 if all_reduce else 1)
    return latency + share * nbytes / bandwidth


def layer_seconds(cost: LayerCost, flops_per_second: float) -> tuple[float, float]:
    """(forward, backward) seconds of a layer on a device of ``flops_per_second``, or as measured."""
    if cost.time is not None:
        share = cost.forward_flops / cost.flops if cost.flops else 1 / 3
        return cost.time * share, cost.time * (1 - share)
    return cost.forward_flops / flops_per_second, (cost.flops - cost.forward_flops) / flops_per_second


def layer_times(
    costs: Sequence[LayerCost], fastest: float, checkpointing: bool, loss: tuple[float, float]
) -> list[tuple[float, float]]:
    """Per layer: forward and backward seconds on a device of ``fastest`` FLOP/s, backward with any recomputation;
    the last layer also runs the loss, ``loss`` (forward, backward) seconds."""
    seconds = []
    for c in costs:
        f, b = layer_seconds(c, fastest)
        seconds.append((f, b + f if checkpointing else b))
    last_f, last_b = seconds[-1]
    seconds[-1] = (last_f + loss[0], last_b + loss[1])
    return seconds


def stage_times(
    seconds: Sequence[tuple[float, float]],
    speeds: Sequence[float],
    costs: Sequence[LayerCost],
    memory: MemoryModel | None,
    stages: Sequence[range],
    cluster: Cluster,
) -> StageCosts:
    """What each stage of the partition ``stages`` costs per micro-batch: compute (``seconds`` per layer on the
    fastest device, over each stage's relative ``speeds``), the transfer of its boundary activation, and the
    activations it keeps (from ``memory``, where given)."""
    n_stages = len(stages)
    boundary = [costs[stages[s].stop - 1].output_bytes for s in range(max(n_stages - 1, 1))]
    return StageCosts.of(
        n_stages,
        forward=[sum(seconds[i][0] for i in r) / speeds[s] for s, r in enumerate(stages)],
        backward=[sum(seconds[i][1] for i in r) / speeds[s] for s, r in enumerate(stages)],
        transfer=[cluster.link_latency + x / cluster.link_bandwidth for x in boundary] if n_stages > 1 else 0.0,
        activation_bytes=None if memory is None else [memory.kept(r.start, r.stop) for r in stages],
    )


def sync_seconds(rank_params: Sequence[float], option: Option, cluster: Cluster) -> float:
    """The replicas' and shards' collectives once per step, for the largest rank's parameters (``rank_params`` bytes
    per rank, tensor-parallel shards already): DDP's ring all-reduce over ``dp``; with FSDP, the all-gather of the
    parameters and the reduce-scatter of the gradients over ``fsdp`` and (HSDP) the all-reduce of the shards over
    ``dp``. Each at the bandwidth of its group's span in rank order (within a node or across)."""
    dp, fsdp, tp = option.dp, option.fsdp, option.tp
    largest = max(rank_params)
    replicas = cluster.bandwidth(option.ranks_per_stage)
    if fsdp == 1:
        return ring_seconds(largest, dp, replicas, cluster.link_latency, all_reduce=True) if dp > 1 else 0.0
    shards = cluster.sharding_bandwidth or cluster.bandwidth(fsdp * tp)
    gather = ring_seconds(largest, fsdp, shards, cluster.link_latency, all_reduce=False)
    across = ring_seconds(largest / fsdp, dp, replicas, cluster.link_latency, all_reduce=True) if dp > 1 else 0.0
    return 2 * gather + across


def optimizer_seconds(rank_params: Sequence[float], devices: Sequence[Device], workload: Workload, fsdp: int) -> float:
    """The slowest rank's optimizer step (on its ``1/fsdp`` shard): measured per parameter, or its state read and
    written at memory speed."""
    per_param = workload.optimizer_seconds_per_param
    return max(
        x / fsdp / 4 * per_param
        if per_param is not None
        else x / fsdp * workload.state_multiplier * 3 / d.memory_bandwidth
        for x, d in zip(rank_params, devices, strict=True)
    )


def tie_seconds(part: Partition, schedule: Schedule, workload: Workload, cluster: Cluster, shards: int) -> float:
    """Summing the gradients of each tied parameter over the ranks that hold it (each its ``1/shards`` part)."""
    ties = 0.0
    for tie in workload.shared:
        holders = {schedule.rank_of(part.stage_of(i)) for i in tie.indices}
        if len(holders) > 1:
            k = len(holders)
            ties += cluster.link_latency + 2 * (k - 1) / k * tie.nbytes / shards / cluster.link_bandwidth
    return ties
