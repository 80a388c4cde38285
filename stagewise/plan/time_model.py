"""The planner's time model: each layer's seconds, each stage's per micro-batch, and the step's collectives."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from stagewise.partition import LayerCost, MemoryModel, Partition
from stagewise.plan.cluster import Cluster, Device
from stagewise.plan.expert_cost import RankExperts
from stagewise.plan.option import Checkpointing, Option
from stagewise.plan.workload import Workload
from stagewise.schedule import Schedule, StageCosts


def ring_seconds(nbytes: float, ranks: int, bandwidth: float, latency: float, *, all_reduce: bool) -> float:
    """A ring all-reduce (or all-gather) of ``nbytes`` over ``ranks``: ``2 (n-1)/n`` (or ``(n-1)/n``) of it on the
    wire at ``bandwidth``, after ``latency``."""
    if ranks == 1:
        return 0.0
    share = (ranks - 1) / ranks * (2 if all_reduce else 1)
    return latency + share * nbytes / bandwidth


def all_to_all_seconds(nbytes: float, ep: int, tp: int, cluster: Cluster) -> float:
    """One all-to-all over ``ep`` expert-parallel ranks, each sending ``nbytes`` split evenly over the group (its
    ``1/ep`` to itself stays) and receiving as much, after ``latency``.

    The group is ``ep`` consecutive data ranks, ``tp`` apart (:attr:`stagewise.comm.Layout.expert_shape`), so a
    node holds ``gpus_per_node / tp`` of them: the share for those goes at :attr:`Cluster.intra_node_bandwidth`,
    the rest at :attr:`Cluster.network_bandwidth`, both at once. Where the group fits in a node (``ep x tp <=
    gpus_per_node``) all of it goes within the node."""
    if ep == 1:
        return 0.0
    local = max(1, min(ep, cluster.gpus_per_node // tp))
    within = nbytes * (local - 1) / ep / cluster.intra_node_bandwidth
    across = nbytes * (ep - local) / ep / cluster.network_bandwidth
    return cluster.link_latency + max(within, across)


def expert_collectives(
    pair: tuple[float, float], experts: RankExperts, option: Option, cluster: Cluster
) -> tuple[float, float]:
    """A layer's collectives per micro-batch (``pair``: forward, backward) with its MoE modules' all-to-alls over
    ``option.ep`` ranks: in each module's forward, the dispatch of the token choices and the combine of their
    outputs, and in its backward the same two in reverse."""
    one = all_to_all_seconds(experts.dispatch_bytes, option.ep, option.tp, cluster)
    return pair[0] + 2 * experts.modules * one, pair[1] + 2 * experts.modules * one


def expert_sync_seconds(expert_bytes: float, option: Option, cluster: Cluster) -> float:
    """The ring all-reduce of the routed experts' gradients (``expert_bytes`` on the rank holding the most) over
    their replicas once per step: ``dp x fsdp / ep`` groups of ``ep`` ranks each hold every expert, at the
    bandwidth of the stage's span."""
    replicas = option.batch_shards // option.ep
    if replicas == 1 or not expert_bytes:
        return 0.0
    bandwidth = cluster.bandwidth(option.ranks_per_stage)
    return ring_seconds(expert_bytes, replicas, bandwidth, cluster.link_latency, all_reduce=True)


def layer_seconds(cost: LayerCost, flops_per_second: float) -> tuple[float, float]:
    """(forward, backward) seconds of a layer on a device of ``flops_per_second``, or as measured."""
    if cost.time is not None:
        share = cost.forward_flops / cost.flops if cost.flops else 1 / 3
        return cost.time * share, cost.time * (1 - share)
    return cost.forward_flops / flops_per_second, (cost.flops - cost.forward_flops) / flops_per_second


def recompute_seconds(cost: LayerCost, device: Device, checkpointing: Checkpointing) -> float:
    """Seconds a backward spends recomputing ``cost``'s forward under ``checkpointing`` (collectives aside).

    Whole layers recompute their forward up to its last saved tensor, that share of its forward's FLOPs
    (:attr:`~stagewise.partition.LayerCost.checkpoint_flops`; the whole forward where not counted). Selective
    recomputes the ops it does not keep: their FLOPs at the device's speed plus the bytes they read and write at its
    memory bandwidth (:attr:`~stagewise.partition.LayerCost.recompute_flops`,
    :attr:`~stagewise.partition.LayerCost.recompute_bytes`); with measured times, those ops' own measured seconds
    (:attr:`~stagewise.partition.LayerCost.recompute_time`), or else that share of the measured forward, the
    forward taken as its FLOPs plus those bytes.
    """
    if checkpointing is False:
        return 0.0
    forward = layer_seconds(cost, device.flops)[0]
    if checkpointing is True:
        if cost.checkpoint_flops is None or not cost.forward_flops:
            return forward
        return forward * min(1.0, cost.checkpoint_flops / cost.forward_flops)
    if cost.time is not None and cost.recompute_time is not None:
        return cost.recompute_time
    moved = cost.recompute_bytes / device.memory_bandwidth
    modelled = cost.recompute_flops / device.flops + moved
    if cost.time is None:
        return modelled
    whole = cost.forward_flops / device.flops + moved
    return forward * modelled / whole if whole > 0 else 0.0


@dataclass(frozen=True)
class Overlapped:
    """Per layer, what moves beside its compute in one micro-batch: seconds on the FSDP shards' links and on
    the host link, for each action kind."""

    gather: float = 0.0
    """All-gathering the layer's parameters (before each action, with ``fsdp_gather="micro-batch"``)."""
    scatter: float = 0.0
    """Reduce-scattering its gradients (after each B or W)."""
    host: float = 0.0
    """Sending its saved activations to the host, or bringing them back (activation offloading)."""


@dataclass(frozen=True)
class ActionSeconds:
    """Per layer: seconds of each action kind for one micro-batch, with recomputation and what is exposed of the
    transfers beside it."""

    forward: float
    backward: float
    """A whole backward B: recomputation once."""
    input_grad: float
    """A split backward's I: recomputation once."""
    weight_grad: float
    """A split backward's W: recomputation again (checkpointing recomputes in each backward graph), and then,
    checkpointed, the whole backward: the recomputed graph holds none of the output gradients I found, so W
    passes the gradient back through the layer again to reach its weights (each linear's input gradient as well
    as its weight's, measured)."""


def action_seconds(
    compute: tuple[float, float],
    collectives: tuple[float, float],
    recompute: float | None,
    moved: Overlapped,
    overlap: bool,
) -> ActionSeconds:
    """One layer's :class:`ActionSeconds` from its ``compute`` (forward, backward) and tensor-parallel
    ``collectives``, ``recompute`` seconds (None: no checkpointing; a recomputed forward repeats its collectives)
    and what is ``moved`` beside it, which costs what it takes beyond the compute where the device ``overlap``-s
    it, else adds to it."""
    (f, b), (cf, cb) = compute, collectives
    again = 0.0 if recompute is None else recompute + cf
    kinds = {
        "forward": (f + cf, _beside(moved.gather, moved.host, overlap)),
        "backward": (b + cb + again, _beside(moved.gather + moved.scatter, moved.host, overlap)),
        "input_grad": (b / 2 + cb + again, _beside(moved.gather, moved.host, overlap)),
        "weight_grad": ((b + cb if recompute is not None else b / 2) + again, moved.gather + moved.scatter),
    }
    return ActionSeconds(
        **{name: (work + beside if not overlap else max(work, beside)) for name, (work, beside) in kinds.items()}
    )


def _beside(links: float, host: float, overlap: bool) -> float:
    """Seconds of transfers on two links: at once where the device overlaps them, else one after the other."""
    return max(links, host) if overlap else links + host


def stage_times(
    seconds: Sequence[tuple[float, float]],
    speeds: Sequence[float],
    costs: Sequence[LayerCost],
    memory: MemoryModel | None,
    stages: Sequence[range],
    cluster: Cluster,
    split: Sequence[tuple[float, float]] | None = None,
) -> StageCosts:
    """What each stage of the partition ``stages`` costs per micro-batch: compute (``seconds`` per layer on the
    fastest device, over each stage's relative ``speeds``; ``split``: each layer's I and W seconds where not
    half of its backward each), the transfer of its boundary activation, and the activations it keeps (from
    ``memory``, where given)."""
    n_stages = len(stages)
    boundary = [costs[stages[s].stop - 1].output_bytes for s in range(max(n_stages - 1, 1))]

    def summed(values: Sequence[tuple[float, float]], which: int) -> list[float]:
        return [sum(values[i][which] for i in r) / speeds[s] for s, r in enumerate(stages)]

    return StageCosts.of(
        n_stages,
        forward=summed(seconds, 0),
        backward=summed(seconds, 1),
        input_grad=None if split is None else summed(split, 0),
        weight_grad=None if split is None else summed(split, 1),
        transfer=[cluster.link_latency + x / cluster.link_bandwidth for x in boundary] if n_stages > 1 else 0.0,
        activation_bytes=None if memory is None else [memory.kept(r.start, r.stop) for r in stages],
    )


def sync_seconds(rank_params: Sequence[float], option: Option, cluster: Cluster) -> float:
    """The replicas' and shards' collectives once per step, for the largest rank's parameters (``rank_params`` bytes
    per rank, tensor-parallel shards already): DDP's ring all-reduce over ``dp``; with FSDP, the all-gather of the
    parameters and the reduce-scatter of the gradients over ``fsdp`` and (HSDP) the all-reduce of the shards over
    ``dp``. Each at the bandwidth of its group's span in rank order (within a node or across)."""
    dp, fsdp = option.dp, option.fsdp
    largest = max(rank_params)
    replicas = cluster.bandwidth(option.ranks_per_stage)
    if fsdp == 1:
        return ring_seconds(largest, dp, replicas, cluster.link_latency, all_reduce=True) if dp > 1 else 0.0
    gather = ring_seconds(largest, fsdp, shard_bandwidth(option, cluster), cluster.link_latency, all_reduce=False)
    across = ring_seconds(largest / fsdp, dp, replicas, cluster.link_latency, all_reduce=True) if dp > 1 else 0.0
    # Gathered per action, the shards' collectives are in each action's seconds (gather_seconds).
    return across + (2 * gather if option.fsdp_gather == "step" else 0.0)


def shard_bandwidth(option: Option, cluster: Cluster) -> float:
    """Bytes per second of FSDP's all-gather and reduce-scatter over ``option``'s shards."""
    return cluster.sharding_bandwidth or cluster.bandwidth(option.fsdp * option.tp)


def gather_seconds(param_bytes: float, option: Option, cluster: Cluster) -> float:
    """An all-gather (or a reduce-scatter) of ``param_bytes`` over ``option``'s FSDP shards, latency aside (it is
    paid once per stage-action, not per layer); 0 unless it gathers per micro-batch."""
    if option.fsdp_gather != "micro-batch" or option.fsdp == 1:
        return 0.0
    return ring_seconds(param_bytes, option.fsdp, shard_bandwidth(option, cluster), 0.0, all_reduce=False)


def optimizer_seconds(
    rank_params: Sequence[float],
    devices: Sequence[Device],
    workload: Workload,
    option: Option,
    cluster: Cluster,
    unsharded: Sequence[float] | None = None,
) -> float:
    """The slowest rank's optimizer step (on its ``1/fsdp`` shard): measured per parameter, or its state read and
    written at memory speed. Offloaded (``option.offload_optimizer``): the gradients sent to the host and the
    parameters back at :attr:`Cluster.host_bandwidth`, and the state read and written by the host at its share
    of :attr:`Cluster.host_optimizer_bandwidth`. ``unsharded``: per rank, bytes of parameters FSDP does not shard
    (the routed experts' ``1/ep`` share), stepped on the device whole."""
    fsdp = option.fsdp
    whole = [0.0] * len(rank_params) if unsharded is None else list(unsharded)
    per_param = workload.optimizer_seconds_per_param

    def on_device(nbytes: float, device: Device) -> float:
        if per_param is not None:
            return nbytes / 4 * per_param
        return nbytes * workload.state_multiplier * 3 / device.memory_bandwidth

    if option.offload_optimizer:
        largest = max(rank_params) / fsdp
        transfers = 2 * largest / (cluster.host_bandwidth or math.inf)
        host = cluster.host_optimizer_bandwidth / cluster.gpus_per_node
        experts = max(on_device(x, d) for x, d in zip(whole, devices, strict=True))
        return transfers + largest * workload.state_multiplier * 3 / host + experts
    return max(on_device(x / fsdp + e, d) for x, e, d in zip(rank_params, whole, devices, strict=True))


def tie_seconds(part: Partition, schedule: Schedule, workload: Workload, cluster: Cluster, shards: int) -> float:
    """Summing the gradients of each tied parameter over the ranks that hold it (each its ``1/shards`` part)."""
    ties = 0.0
    for tie in workload.shared:
        holders = {schedule.rank_of(part.stage_of(i)) for i in tie.indices}
        if len(holders) > 1:
            k = len(holders)
            ties += cluster.link_latency + 2 * (k - 1) / k * tie.nbytes / shards / cluster.link_bandwidth
    return ties
