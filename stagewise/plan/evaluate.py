"""evaluate(): one layout's step time, bubble and memory per rank, or why it cannot run."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from dataclasses import dataclass

from stagewise.partition import (
    CapacityError,
    LayerCost,
    MemoryModel,
    Partition,
    SharedParameter,
    balance,
    memory_model,
    params_of,
)
from stagewise.plan.cluster import Cluster, Device
from stagewise.plan.option import Option
from stagewise.plan.tensor_traffic import REPLICATED_ACTIVATIONS, LayerTraffic, ring_seconds
from stagewise.plan.workload import Workload
from stagewise.schedule import Schedule, ScheduleName, StageCosts, build, holdings, simulate
from stagewise.schedule.holdings import FREE, Holding


def _scaled(costs: Sequence[LayerCost], factor: float, checkpointing: bool, input_bytes: float) -> list[LayerCost]:
    """Costs of a micro-batch ``factor`` times the profiled one; with checkpointing, only layer inputs are kept.

    The last layer also holds what the loss saves for backward, taken as one
    tensor the size of the model's output (cross-entropy keeps its
    log-softmax, a squared error its difference); what else the loss holds
    while it runs (:attr:`Workload.loss_bytes`) is the last stage's working memory (:func:`_working`).
    """
    out = []
    previous = input_bytes
    for index, c in enumerate(costs):
        saved = previous if checkpointing else c.saved_bytes * factor
        if index == len(costs) - 1:
            saved += c.output_bytes * factor  # the loss keeps a tensor the size of the output (log-softmax, error)
        out.append(
            dataclasses.replace(
                c,
                flops=int(c.flops * factor),
                forward_flops=int(c.forward_flops * factor),
                output_bytes=int(c.output_bytes * factor),
                saved_bytes=int(saved),
                shared_bytes=0 if checkpointing else int(c.shared_bytes * factor),  # each keeps its own input
                time=None if c.time is None else c.time * factor,
                pooled_bytes=int(c.pooled_bytes * factor),
                use_bytes=int(c.use_bytes * factor),
                working_bytes=int(c.working_bytes * factor),
            )
        )
        previous = c.output_bytes * factor
    return out


def _layer_seconds(cost: LayerCost, flops_per_second: float) -> tuple[float, float]:
    """(forward, backward) seconds of a layer on a device of ``flops_per_second``, or as measured."""
    if cost.time is not None:
        share = cost.forward_flops / cost.flops if cost.flops else 1 / 3
        return cost.time * share, cost.time * (1 - share)
    return cost.forward_flops / flops_per_second, (cost.flops - cost.forward_flops) / flops_per_second


@dataclass(frozen=True)
class _Setting:
    """One option made concrete: its schedule, per-layer costs at its micro-batch size, and its devices."""

    schedule: Schedule
    devices: list[Device]
    """Per pipeline rank: the weakest device among its replicas."""
    costs: list[LayerCost]
    seconds: list[tuple[float, float]]
    """Per layer: forward and backward seconds on the fastest device (backward includes recomputation)."""
    speeds: list[float]
    memory: MemoryModel
    capacities: list[float]
    transient: list[float]
    """Per stage, at most: bytes it holds on top of its memory model while it computes one micro-batch (see
    :func:`_working`), whichever layers it gets; what the partition must leave free."""
    recompute: float
    """Bytes of one layer's activations recomputed at once under activation checkpointing."""
    loss_extra: float
    """Bytes the loss holds beyond the output-sized tensor counted as saved, on the last stage."""
    shared: tuple[SharedParameter, ...]
    """The tied parameters, each its bytes on one rank (a tensor-parallel shard where its layers split)."""


@functools.lru_cache(maxsize=256)
def cached_schedule(name: ScheduleName, n_stages: int, n_microbatches: int, n_virtual: int) -> Schedule:
    """:func:`~stagewise.schedule.build`, once per shape: :func:`candidates` and :func:`evaluate` ask for the same."""
    return build(name, n_stages, n_microbatches, n_virtual=n_virtual)


@functools.lru_cache(maxsize=256)
def _cached_holdings(
    name: ScheduleName, n_stages: int, n_microbatches: int, n_virtual: int, checkpointing: bool, pooled: bool
) -> tuple[tuple[Holding, ...], ...]:
    """:func:`~stagewise.schedule.holdings` of a built-in schedule, once per shape: layouts that differ only in
    their data-parallel and sharded dimensions share it. ``pooled``: with Pipeline's default weight-gradient
    pool; sharded stages have none (their gradients accumulate through autograd)."""
    schedule = cached_schedule(name, n_stages, n_microbatches, n_virtual)
    return holdings(schedule, FREE if pooled else None, checkpointing=checkpointing)


def _shape_error(option: Option, workload: Workload, cluster: Cluster) -> str | None:
    """Why ``option``'s shape cannot take ``workload``: more stages than layers, a batch that does not divide, a
    tensor-parallel group that would cross a node or that the model's plan cannot split."""
    n_stages = option.pp * option.n_virtual
    if len(workload.costs) < n_stages:
        return f"{n_stages} stages for {len(workload.costs)} layers"
    shards = option.batch_shards
    if workload.global_batch % shards:
        what = f"dp={option.dp}" if option.fsdp == 1 else f"dp x fsdp = {shards}"
        return f"global batch {workload.global_batch} not divisible by {what}"
    local = workload.global_batch // shards
    if local % option.n_microbatches:
        return f"batch {local} per replica not divisible by m={option.n_microbatches}"
    if option.tp > 1:
        if cluster.gpus_per_node % option.tp:
            return (
                f"tp={option.tp} does not divide the {cluster.gpus_per_node} GPUs of a node: its group would cross one"
            )
        traffic = workload.traffic(option.tp)
        if isinstance(traffic, str):
            return traffic
    return None


def _tensor_parallel(costs: list[LayerCost], traffic: Sequence[LayerTraffic] | None, tp: int) -> list[LayerCost]:
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
            )
        )
    return out


def _tp_seconds(
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


def _split_ties(
    shared: Sequence[SharedParameter], traffic: Sequence[LayerTraffic] | None, tp: int
) -> tuple[SharedParameter, ...]:
    """The tied parameters as one rank holds them: ``1/tp`` of one whose layers all split (a GPT's vocabulary)."""
    if traffic is None:
        return tuple(shared)
    return tuple(
        dataclasses.replace(tie, nbytes=tie.nbytes // tp) if all(traffic[i].split for i in tie.indices) else tie
        for tie in shared
    )


def _state_multiplier(multiplier: float, fsdp: int) -> float:
    """Copies of each parameter a rank holds at its fullest: without FSDP, ``multiplier`` (weights, gradients,
    optimizer state); with it, ``1/fsdp`` of those plus, during the step, the whole parameters and gradients."""
    return multiplier if fsdp == 1 else 2 + multiplier / fsdp


def _seconds(
    costs: Sequence[LayerCost], fastest: float, checkpointing: bool, loss: tuple[float, float]
) -> list[tuple[float, float]]:
    """Per layer: forward and backward seconds on a device of ``fastest`` FLOP/s, backward with any recomputation;
    the last layer also runs the loss, ``loss`` (forward, backward) seconds."""
    seconds = []
    for c in costs:
        f, b = _layer_seconds(c, fastest)
        seconds.append((f, b + f if checkpointing else b))
    last_f, last_b = seconds[-1]
    seconds[-1] = (last_f + loss[0], last_b + loss[1])
    return seconds


def _shared_device(n_virtual: int) -> str:
    """Why a stage's memory is a fraction of its device's, where it is."""
    if n_virtual == 1:
        return ""
    return f"; each device holds {n_virtual} stages of the interleaved schedule, so a stage gets 1/{n_virtual} of it"


def _transient_error(transient: Sequence[float], have: Sequence[float], recompute: float, loss: float) -> str | None:
    """Why computing one micro-batch (``transient`` bytes per stage) overflows a stage's ``have``, if it does."""
    last = len(transient) - 1
    for s, (need, own) in enumerate(zip(transient, have, strict=True)):
        if need >= own:
            what = "the loss" if s == last and need == recompute + loss else "one layer"
            where = "the last stage" if s == last else f"stage {s}"
            return f"{what} on one micro-batch needs {need / 2**30:.1f} GiB >= {own / 2**30:.1f} GiB on {where}"
    return None


def _setting(option: Option, workload: Workload, cluster: Cluster) -> _Setting | str:
    """The concrete setting of ``option``, or why it cannot run."""
    why = _shape_error(option, workload, cluster)
    if why is not None:
        return why
    pp, v, m, tp = option.pp, option.n_virtual, option.n_microbatches, option.tp
    n_stages = pp * v
    schedule = cached_schedule(option.schedule, n_stages, m, v)
    factor = workload.global_batch // option.batch_shards // m / workload.profiled_batch
    ckpt = option.activation_checkpointing
    found = workload.traffic(tp) if tp > 1 else None
    traffic = found if not isinstance(found, str) else None  # a refusal was _shape_error's
    whole = _scaled(workload.costs, factor, ckpt, workload.input_bytes * factor)
    costs = _tensor_parallel(whole, traffic, tp)
    devices = cluster.stage_devices(pp, option.ranks_per_stage)
    fastest = max(d.flops for d in devices)
    recompute = max(c.saved_bytes for c in workload.costs) * factor if ckpt else 0.0
    smallest = min(d.memory for d in devices) / v
    if recompute >= smallest:
        return (
            f"recomputing one layer needs {recompute / 2**30:.1f} GiB >= {smallest / 2**30:.1f} GiB per stage"
            f"{_shared_device(v)}"
        )
    # What the loss holds beyond the output-sized tensor _scaled counts as saved.
    loss_extra = 0.0 if workload.loss_bytes is None else max(0.0, workload.loss_bytes * factor - costs[-1].output_bytes)
    every = range(len(costs))
    last = _working(costs, every, recompute, loss_extra)
    transient = [_working(costs, every[:-1], recompute, 0.0)] * (n_stages - 1) + [last]  # only it has the last layer
    have = [devices[schedule.rank_of(s)].memory / v for s in range(n_stages)]
    why = _transient_error(transient, have, recompute, loss_extra)
    if why is not None:
        return why + _shared_device(v)
    loss_f, loss_b = workload.loss_seconds
    shared = _split_ties(workload.shared, traffic, tp)
    collectives = _tp_seconds(costs, traffic, tp, cluster, workload.input_bytes * factor)
    computed = _seconds(costs, fastest, ckpt, (loss_f * factor, loss_b * factor))
    return _Setting(
        schedule=schedule,
        devices=devices,
        costs=costs,
        # A recomputed forward repeats its collectives.
        seconds=[
            (f + cf, b + cb + (cf if ckpt else 0.0)) for (f, b), (cf, cb) in zip(computed, collectives, strict=True)
        ],
        speeds=[devices[schedule.rank_of(s)].flops / fastest for s in range(n_stages)],
        # What the schedule's own actions hold, with Pipeline's default weight-gradient pool.
        memory=memory_model(
            costs,
            schedule=schedule,
            holdings=_cached_holdings(option.schedule, n_stages, m, v, ckpt, option.fsdp == 1 and tp == 1),
            state_multiplier=_state_multiplier(workload.state_multiplier, option.fsdp),
            shared=shared,
        ),
        capacities=[own - t for own, t in zip(have, transient, strict=True)],
        transient=transient,
        recompute=recompute,
        loss_extra=loss_extra,
        shared=shared,
    )


def _working(costs: Sequence[LayerCost], layers: Sequence[int], recompute: float, loss: float) -> float:
    """Bytes a stage of ``layers`` holds on top of its memory model while it computes one micro-batch: the most
    that one of its layers holds for a moment (:attr:`LayerCost.working_bytes`) or, on the last stage, the loss;
    with activation checkpointing also the layer it recomputes."""
    return recompute + max([loss, *(costs[i].working_bytes for i in layers)])


def _gib(need: float, have: float) -> tuple[str, str]:
    """Both sizes in GiB, with one decimal, or as many more as it takes to tell them apart."""
    for digits in (1, 3, 6):
        pair = f"{need / 2**30:.{digits}f}", f"{have / 2**30:.{digits}f}"
        if pair[0] != pair[1]:
            break
    return pair


def _balanced(option: Option, setting: _Setting, weights: Sequence[float]) -> Partition | Option:
    """The fastest partition of ``weights`` within each stage's memory; or ``option`` rejected, naming the stage
    that overflows its own device in the leanest split."""
    n_stages = setting.schedule.n_stages
    try:
        return balance(weights, n_stages, speeds=setting.speeds, memory=setting.memory, capacities=setting.capacities)
    except CapacityError:
        # The split that uses the least of each stage's own device, and the stage that overflows in it.
        lean = balance(setting.memory, n_stages, speeds=setting.capacities)
        worst = max(range(n_stages), key=lambda s: lean.loads[s] - setting.capacities[s])  # the most over its device
        need, cap = _gib(
            lean.loads[worst] + setting.transient[worst], setting.capacities[worst] + setting.transient[worst]
        )
        reason = f"stage {worst} needs {need} GiB > {cap} GiB (in the leanest split){_shared_device(option.n_virtual)}"
        # A rank of v such stages; it computes one micro-batch at a time, so holds the transient once.
        rank = lean.loads[worst] * option.n_virtual + setting.transient[worst]
        return dataclasses.replace(option, rejected=reason, rank_memory=(rank,))


def _stage_costs(setting: _Setting, stages: Sequence[range], cluster: Cluster) -> StageCosts:
    """What each stage of the partition ``stages`` costs per micro-batch: compute, transfer, activations kept."""
    seconds, speeds, n_stages = setting.seconds, setting.speeds, len(stages)
    boundary = [setting.costs[stages[s].stop - 1].output_bytes for s in range(max(n_stages - 1, 1))]
    return StageCosts.of(
        n_stages,
        forward=[sum(seconds[i][0] for i in r) / speeds[s] for s, r in enumerate(stages)],
        backward=[sum(seconds[i][1] for i in r) / speeds[s] for s, r in enumerate(stages)],
        transfer=[cluster.link_latency + x / cluster.link_bandwidth for x in boundary] if n_stages > 1 else 0.0,
        activation_bytes=[setting.memory.kept(r.start, r.stop) for r in stages],
    )


def _sync_seconds(rank_params: Sequence[int], option: Option, cluster: Cluster) -> float:
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


def _optimizer_seconds(rank_params: Sequence[int], devices: Sequence[Device], workload: Workload, fsdp: int) -> float:
    """The slowest rank's optimizer step (on its ``1/fsdp`` shard): measured per parameter, or its state read and
    written at memory speed."""
    per_param = workload.optimizer_seconds_per_param
    return max(
        x / fsdp / 4 * per_param
        if per_param is not None
        else x / fsdp * workload.state_multiplier * 3 / d.memory_bandwidth
        for x, d in zip(rank_params, devices, strict=True)
    )


def _tie_seconds(part: Partition, schedule: Schedule, workload: Workload, cluster: Cluster, shards: int) -> float:
    """Summing the gradients of each tied parameter over the ranks that hold it (each its ``1/shards`` part)."""
    ties = 0.0
    for tie in workload.shared:
        holders = {schedule.rank_of(part.stage_of(i)) for i in tie.indices}
        if len(holders) > 1:
            k = len(holders)
            ties += cluster.link_latency + 2 * (k - 1) / k * tie.nbytes / shards / cluster.link_bandwidth
    return ties


def _rank_activation(setting: _Setting, stages: Sequence[range]) -> list[float]:
    """Per rank: the bytes its stages hold for backward at their fullest (micro-batches in flight and pooled weight
    gradients) plus the most that computing one micro-batch holds on top."""
    memory, schedule, last = setting.memory, setting.schedule, len(stages) - 1
    return [
        sum(memory.stage_bytes(s, stages[s].start, stages[s].stop) - memory.fixed_bytes(stages[s]) for s in mine)
        + max(  # a rank computes one micro-batch at a time
            _working(setting.costs, stages[s], setting.recompute, setting.loss_extra if s == last else 0.0)
            for s in mine
        )
        for mine in (schedule.stages_of(r) for r in range(schedule.n_ranks))
    ]


def stage_costs(option: Option, workload: Workload, cluster: Cluster) -> StageCosts:
    """What each stage of an evaluated ``option`` (one with its partition) costs per micro-batch, as its step was
    simulated: compute on its device, the transfer after it, the activations it keeps."""
    setting = _setting(option, workload, cluster)
    if isinstance(setting, str) or option.partition is None:
        raise ValueError(f"{option.describe()} has no partition to cost: {option.rejected or setting}")
    b = option.partition.bounds
    return _stage_costs(setting, [range(b[s], b[s + 1]) for s in range(len(b) - 1)], cluster)


def evaluate(option: Option, workload: Workload, cluster: Cluster) -> Option:
    """The partition, simulated step time and memory of ``option``; or why it cannot run."""
    setting = _setting(option, workload, cluster)
    if isinstance(setting, str):
        return dataclasses.replace(option, rejected=setting)
    part = _balanced(option, setting, [f + b for f, b in setting.seconds])
    if isinstance(part, Option):
        return part
    sched, b = setting.schedule, part.bounds
    stages = [range(b[s], b[s + 1]) for s in range(sched.n_stages)]
    result = simulate(sched, _stage_costs(setting, stages, cluster))
    # Each rank's layers over all its stages: Pipeline keeps one copy of a tied parameter per rank.
    rank_layers = [frozenset(i for s in sched.stages_of(r) for i in stages[s]) for r in range(option.pp)]
    rank_params = [params_of(setting.costs, setting.shared, layers, nbytes=True) for layers in rank_layers]
    step = (
        result.step_time
        + _sync_seconds(rank_params, option, cluster)
        + _optimizer_seconds(rank_params, setting.devices, workload, option.fsdp)
        + _tie_seconds(part, sched, workload, cluster, option.fsdp * option.tp)
    )
    fixed = [setting.memory.fixed_bytes(layers) for layers in rank_layers]
    acts = _rank_activation(setting, stages)
    return dataclasses.replace(
        option,
        partition=part,
        step_time=step,
        bubble=result.bubble,
        rank_memory=tuple(f + a for f, a in zip(fixed, acts, strict=True)),
        rank_activation=tuple(acts),
        samples_per_second=workload.global_batch / step,
        simulation=result,
    )
