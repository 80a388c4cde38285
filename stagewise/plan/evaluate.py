"""evaluate(): one layout's partition, simulated step time and memory per rank, or why it cannot run."""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from stagewise.partition import CapacityError, Partition, balance
from stagewise.partition.auto import params_of
from stagewise.plan.cluster import Cluster
from stagewise.plan.option import Option
from stagewise.plan.rank_memory import (
    end_multiplier,
    optimizer_bytes,
    rank_activation,
    step_multiplier,
    whole_copies,
)
from stagewise.plan.rejection import Rejection, memory_rejection
from stagewise.plan.setting import Layers, Setting, Settings, cached_shape
from stagewise.plan.time_model import expert_sync_seconds, optimizer_seconds, stage_times, sync_seconds, tie_seconds
from stagewise.plan.workload import Workload
from stagewise.schedule import Schedule, StageCosts, simulate
from stagewise.schedule.simulate import SimulationResult


def rejected(option: Option, why: Rejection) -> Option:
    """``option`` refused for ``why`` (with the memory its fullest rank would need, where that is what overflows)."""
    if why.rank_memory:
        return dataclasses.replace(option, rejected=why.reason, rank_memory=why.rank_memory)
    return dataclasses.replace(option, rejected=why.reason)


def partitioned(setting: Setting) -> Partition | Rejection:
    """The fastest partition of ``setting``'s layers within each stage's memory; or, where none fits, the stage that
    overflows its own device in the leanest split."""
    n_stages = setting.n_stages
    weights = [f + b for f, b in setting.seconds]
    try:
        return balance(weights, n_stages, speeds=setting.speeds, memory=setting.memory, capacities=setting.capacities)
    except CapacityError:
        return memory_rejection(setting.memory, setting.capacities, setting.transient, setting.option.n_virtual)


def stage_ranges(part: Partition) -> list[range]:
    """Each stage's layers."""
    b = part.bounds
    return [range(b[s], b[s + 1]) for s in range(len(b) - 1)]


def timed(setting: Setting, part: Partition, cluster: Cluster) -> StageCosts:
    """What each stage of ``part`` costs per micro-batch in ``setting``, as its schedule is simulated."""
    return stage_times(
        setting.seconds, setting.speeds, setting.costs, setting.memory, stage_ranges(part), cluster,
        split=setting.layers.split,
    )  # fmt: skip


def _rank_layers(schedule: Schedule, stages: Sequence[range]) -> list[frozenset[int]]:
    """Each rank's layers over all its stages: Pipeline keeps one copy of a tied parameter per rank."""
    return [frozenset(i for s in schedule.stages_of(r) for i in stages[s]) for r in range(schedule.n_ranks)]


@dataclass(frozen=True)
class Overheads:
    """What a step spends beyond its pipeline's schedule, once per step."""

    sync: float
    """The replicas' and shards' collectives (:func:`~stagewise.plan.time_model.sync_seconds`)."""
    optimizer: float
    """The slowest rank's optimizer step."""
    ties: float
    """Summing the gradients of tied parameters held on several ranks."""
    experts: float = 0.0
    """All-reducing the routed experts' gradients over their replicas
    (:func:`~stagewise.plan.time_model.expert_sync_seconds`)."""

    def step(self, pipeline: float) -> float:
        """The step's seconds, after ``pipeline`` seconds of the schedule's actions."""
        return pipeline + self.sync + self.optimizer + self.ties + self.experts


def overheads(setting: Setting, part: Partition, workload: Workload, cluster: Cluster) -> Overheads:
    """The once-per-step seconds of ``setting`` split as ``part``, whose ranks hold their stages' parameters."""
    option, schedule = setting.option, setting.schedule
    layers = _rank_layers(schedule, stage_ranges(part))
    rank_params = [params_of(setting.costs, setting.layers.shared, mine, nbytes=True) for mine in layers]
    rank_experts = expert_bytes(setting.layers, layers)
    return Overheads(
        sync=sync_seconds(rank_params, option, cluster),
        optimizer=optimizer_seconds(rank_params, setting.devices, workload, option, cluster, unsharded=rank_experts),
        ties=tie_seconds(part, schedule, workload, cluster, option.fsdp * option.tp),
        experts=expert_sync_seconds(max(rank_experts), option, cluster),
    )


def expert_bytes(layers: Layers, ranks: Sequence[Collection[int]]) -> list[float]:
    """Per rank holding the layers ``ranks`` lists: the bytes of its share of the routed experts' parameters."""
    if not layers.expert_bytes:
        return [0.0] * len(ranks)
    return [sum(layers.expert_bytes[i] for i in mine) for mine in ranks]


def host_bytes(setting: Setting, part: Partition) -> list[float]:
    """Per rank: the host bytes its offloading keeps, its share of the optimizer state and the saved activations
    of its stages' micro-batches in flight (all of them, at its peak); none without offloading."""
    option, schedule, memory = setting.option, setting.schedule, setting.memory
    stages = stage_ranges(part)
    out = []
    for rank, mine in enumerate(_rank_layers(schedule, stages)):
        state = params_of(setting.costs, setting.layers.shared, mine, nbytes=True) * setting.host_state
        acts = 0.0
        if option.offload_activations:
            peaks = cached_shape(option.schedule, schedule.n_stages, option.n_microbatches, option.n_virtual).peaks
            acts = sum(peaks[s] * memory.kept(stages[s].start, stages[s].stop) for s in schedule.stages_of(rank))
        out.append(state + acts)
    return out


def measured(
    setting: Setting, part: Partition, result: SimulationResult, extra: Overheads, workload: Workload, cluster: Cluster
) -> Option:
    """``setting``'s option with its partition ``part``, its schedule's simulated ``result`` and ``extra`` seconds:
    its step time, bubble, and memory per rank (and host memory, offloading; a layout whose host memory
    overflows its share of the node's, :attr:`Cluster.host_share`, rejected)."""
    memory, schedule, layers = setting.memory, setting.schedule, setting.layers
    stages = stage_ranges(part)
    mine = _rank_layers(schedule, stages)
    fixed = [memory.fixed_bytes(held) for held in mine]
    acts = rank_activation(memory, schedule, layers.costs, stages, layers.recompute, layers.loss_extra)
    peaks = [f + a for f, a in zip(fixed, acts, strict=True)]
    params = [params_of(setting.costs, layers.shared, held, nbytes=True) for held in mine]
    ending = end_multiplier(workload.state_multiplier, setting.option)
    if ending:  # FSDP's reduce-scatter as a step gathered once ends: more whole copies, no activations
        peaks = [max(peak, f + (ending - setting.state) * p) for peak, f, p in zip(peaks, fixed, params, strict=True)]
    if setting.option.fsdp > 1 and setting.option.fsdp_gather == "micro-batch" and not setting.option.offload_optimizer:
        peaks = per_action_peaks(setting, stages, fixed, params, acts)
    stepping = stepping_bytes(setting, mine, fixed, params, workload.state_multiplier)
    peaks = [max(peak, s) for peak, s in zip(peaks, stepping, strict=True)]
    step = extra.step(result.step_time)
    option = setting.option
    host = host_bytes(setting, part) if option.offload_optimizer or option.offload_activations else []
    why = host_rejection(host, cluster)
    return dataclasses.replace(
        option,
        partition=part,
        step_time=step,
        bubble=result.bubble,
        rank_memory=tuple(peaks),
        rank_activation=tuple(acts),
        rank_host_memory=tuple(host),
        samples_per_second=workload.global_batch / step,
        simulation=result,
        rejected=why,
    )


def per_action_peaks(
    setting: Setting, stages: Sequence[range], fixed: Sequence[float], params: Sequence[float], acts: Sequence[float]
) -> list[float]:
    """Per rank whose stages FSDP gathers around each action (``fsdp_gather="micro-batch"``; ``fixed`` bytes of
    its memory model, ``params`` bytes of parameters, ``acts`` of activations at their fullest): the more of two
    moments, with its share of the sharded state and one of its stages whole at a time (``W`` bytes of whole
    parameters, its largest stage's):

    - amid the activations at their fullest: the whole parameters and the whole gradients a backward makes
      while it frees its micro-batch's activations (``2 W``);
    - the reduce-scatter after a backward: the whole parameters, gradients and the reduce-scatter's input
      (``3 W``), that backward's micro-batch freed (the stage's one micro-batch's activations less).

    The search's fit test counts :func:`~stagewise.plan.rank_memory.whole_copies` amid the activations instead,
    more than either."""
    option, costs, shared, memory = setting.option, setting.costs, setting.layers.shared, setting.memory
    copies = whole_copies(option)
    out = []
    for rank, (f, p, a) in enumerate(zip(fixed, params, acts, strict=True)):
        sharded = f - copies * p
        whole = [(params_of(costs, shared, stages[s], nbytes=True), s) for s in setting.schedule.stages_of(rank)]
        amid = sharded + 2 * max(w for w, _ in whole) + a
        after = max(sharded + 3 * w + a - memory.kept(stages[s].start, stages[s].stop) for w, s in whole)
        out.append(max(amid, after))
    return out


def stepping_bytes(
    setting: Setting,
    ranks: Sequence[Collection[int]],
    fixed: Sequence[float],
    params: Sequence[float],
    multiplier: float,
) -> list[float]:
    """Per rank holding the layers ``ranks`` lists (``fixed`` bytes of its memory model, ``params`` bytes of
    parameters): what it holds while its optimizer steps, the activations gone: its share of the weights,
    gradients and optimizer state (:func:`~stagewise.plan.rank_memory.step_multiplier`), its buffers, and the
    step's temporaries over that share (:func:`~stagewise.plan.rank_memory.optimizer_bytes`). The fullest
    moment of a rank whose activations are small (a first or last stage under activation checkpointing)."""
    option, costs = setting.option, setting.costs
    held = step_multiplier(multiplier, option)
    out = []
    for layers, f, p in zip(ranks, fixed, params, strict=True):
        if option.offload_optimizer or not layers:
            out.append(f - setting.state * p)
            continue
        largest = max(costs[i].param_bytes for i in layers)  # a layer's parameters stand for its largest tensor
        temporaries = optimizer_bytes(p, largest, multiplier) / option.fsdp
        out.append(f + (held - setting.state) * p + temporaries)
    return out


def host_rejection(host: Sequence[float], cluster: Cluster) -> str | None:
    """Why ranks keeping ``host`` bytes each in host memory overflow their share of a node's, if they do."""
    if not host or max(host) <= cluster.host_share:
        return None
    rank = max(range(len(host)), key=lambda r: host[r])
    return (
        f"rank {rank} offloads {host[rank] / 2**30:.1f} GiB to the host > {cluster.host_share / 2**30:.1f} GiB "
        f"(its share of {(cluster.host_memory or 0) / 2**30:.0f} GiB per node over {cluster.gpus_per_node} GPUs)"
    )


def stage_costs(option: Option, workload: Workload, cluster: Cluster) -> StageCosts:
    """What each stage of an evaluated ``option`` (one with its partition) costs per micro-batch, as its step was
    simulated: compute on its device, the transfer after it, the activations it keeps."""
    setting = Settings(workload, cluster).of(option)
    if isinstance(setting, Rejection) or option.partition is None:
        why = setting.reason if isinstance(setting, Rejection) else "it was not evaluated"
        raise ValueError(f"{option.describe()} has no partition to cost: {option.rejected or why}")
    return timed(setting, option.partition, cluster)


def evaluate(option: Option, workload: Workload, cluster: Cluster) -> Option:
    """The partition, simulated step time and memory of ``option``; or why it cannot run."""
    setting = Settings(workload, cluster).of(option)
    if isinstance(setting, Rejection):
        return rejected(option, setting)
    part = partitioned(setting)
    if isinstance(part, Rejection):
        return rejected(option, part)
    result = simulate(setting.schedule, timed(setting, part, cluster), cores=setting.cores)
    return measured(setting, part, result, overheads(setting, part, workload, cluster), workload, cluster)
