"""evaluate(): one layout's step time, bubble and memory per rank, or why it cannot run."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from dataclasses import dataclass

from stagewise.partition import CapacityError, LayerCost, MemoryModel, Partition, balance, memory_model, params_of
from stagewise.plan.cluster import Cluster, Device
from stagewise.plan.option import Option
from stagewise.plan.workload import Workload
from stagewise.schedule import Schedule, ScheduleName, StageCosts, build, holdings, simulate


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


@functools.lru_cache(maxsize=256)
def cached_schedule(name: ScheduleName, n_stages: int, n_microbatches: int, n_virtual: int) -> Schedule:
    """:func:`~stagewise.schedule.build`, once per shape: :func:`candidates` and :func:`evaluate` ask for the same."""
    return build(name, n_stages, n_microbatches, n_virtual=n_virtual)


def _shape_error(option: Option, workload: Workload) -> str | None:
    """Why ``option``'s shape cannot take ``workload``: more stages than layers, or a batch that does not divide."""
    n_stages = option.pp * option.n_virtual
    if len(workload.costs) < n_stages:
        return f"{n_stages} stages for {len(workload.costs)} layers"
    if workload.global_batch % option.dp:
        return f"global batch {workload.global_batch} not divisible by dp={option.dp}"
    local = workload.global_batch // option.dp
    if local % option.n_microbatches:
        return f"batch {local} per replica not divisible by m={option.n_microbatches}"
    return None


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
    why = _shape_error(option, workload)
    if why is not None:
        return why
    pp, dp, v, m = option.pp, option.dp, option.n_virtual, option.n_microbatches
    n_stages = pp * v
    schedule = cached_schedule(option.schedule, n_stages, m, v)
    factor = workload.global_batch // dp // m / workload.profiled_batch
    ckpt = option.activation_checkpointing
    costs = _scaled(workload.costs, factor, ckpt, workload.input_bytes * factor)
    devices = cluster.stage_devices(pp, dp)
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
    return _Setting(
        schedule=schedule,
        devices=devices,
        costs=costs,
        seconds=_seconds(costs, fastest, ckpt, (loss_f * factor, loss_b * factor)),
        speeds=[devices[schedule.rank_of(s)].flops / fastest for s in range(n_stages)],
        # What the schedule's own actions hold, with Pipeline's default weight-gradient pool.
        memory=memory_model(
            costs,
            schedule=schedule,
            holdings=holdings(schedule, checkpointing=ckpt),
            state_multiplier=workload.state_multiplier,
            shared=workload.shared,
        ),
        capacities=[own - t for own, t in zip(have, transient, strict=True)],
        transient=transient,
        recompute=recompute,
        loss_extra=loss_extra,
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


def _allreduce_seconds(rank_params: Sequence[int], dp: int, cluster: Cluster) -> float:
    """DDP's ring all-reduce of the largest rank's gradients (``rank_params`` bytes per rank) over ``dp`` replicas."""
    return max(2 * (dp - 1) / dp * x / cluster.network_bandwidth for x in rank_params)


def _optimizer_seconds(rank_params: Sequence[int], devices: Sequence[Device], workload: Workload) -> float:
    """The slowest rank's optimizer step: measured per parameter, or its state read and written at memory speed."""
    per_param = workload.optimizer_seconds_per_param
    return max(
        x / 4 * per_param if per_param is not None else x * workload.state_multiplier * 3 / d.memory_bandwidth
        for x, d in zip(rank_params, devices, strict=True)
    )


def _tie_seconds(part: Partition, schedule: Schedule, workload: Workload, cluster: Cluster) -> float:
    """Summing the gradients of each tied parameter over the ranks that hold it."""
    ties = 0.0
    for tie in workload.shared:
        holders = {schedule.rank_of(part.stage_of(i)) for i in tie.indices}
        if len(holders) > 1:
            k = len(holders)
            ties += cluster.link_latency + 2 * (k - 1) / k * tie.nbytes / cluster.link_bandwidth
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
    rank_params = [params_of(setting.costs, workload.shared, layers, nbytes=True) for layers in rank_layers]
    step = (
        result.step_time
        + _allreduce_seconds(rank_params, option.dp, cluster)
        + _optimizer_seconds(rank_params, setting.devices, workload)
        + _tie_seconds(part, sched, workload, cluster)
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
