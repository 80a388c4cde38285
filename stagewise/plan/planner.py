"""plan(): the fastest layout that fits — pipeline depth, data parallelism, micro-batches, schedule, checkpointing."""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, get_args

from stagewise.partition import CapacityError, LayerCost, MemoryModel, Partition, balance, memory_model, params_of
from stagewise.plan.cluster import Cluster, Device
from stagewise.plan.workload import Workload
from stagewise.schedule import BUILDERS, Schedule, ScheduleName, StageCosts, build, holdings, simulate
from stagewise.schedule.simulate import SimulationResult

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Option:
    """One layout and what it costs, or why it was rejected."""

    pp: int
    dp: int
    n_virtual: int
    n_microbatches: int
    schedule: ScheduleName
    activation_checkpointing: bool
    partition: Partition | None = None
    step_time: float = math.inf
    """Predicted seconds per optimizer step."""
    bubble: float = 0.0
    rank_memory: tuple[float, ...] = ()
    """Predicted peak bytes of each pipeline rank (parameter state plus activations)."""
    rank_activation: tuple[float, ...] = ()
    """Predicted peak bytes of saved activations on each pipeline rank."""
    samples_per_second: float = 0.0
    rejected: str | None = None
    """Why the layout does not work; None when it does."""
    simulation: SimulationResult | None = field(default=None, repr=False, compare=False)

    def describe(self) -> str:
        ckpt = " +ckpt" if self.activation_checkpointing else ""
        return f"pp={self.pp} dp={self.dp} m={self.n_microbatches} {self.schedule}{ckpt}"


@dataclass(frozen=True)
class Plan:
    """Every layout considered: the feasible ones fastest first, the rejected ones with their reasons."""

    options: tuple[Option, ...]
    rejected: tuple[Option, ...]
    smallest_memory: float | None
    """When nothing fits: the least memory per device that some layout would need."""

    @property
    def best(self) -> Option | None:
        return self.options[0] if self.options else None

    def to_json(self, workload: Workload, *, model: str, seq_len: int | None, optimizer: str | None = None) -> str:
        """The best option as the JSON that ``stagewise train --plan`` reads."""
        best = self.best
        if best is None or best.partition is None:
            raise ValueError("no layout fits, so there is no plan to write")
        return json.dumps(
            {
                "model": model,
                "stages": best.pp,
                "dp": best.dp,
                "virtual": best.n_virtual,
                "schedule": best.schedule,
                "microbatches": best.n_microbatches,
                "batch_size": workload.global_batch,
                "seq_len": seq_len,
                "activation_checkpointing": best.activation_checkpointing,
                "optimizer": optimizer,
                "partition": list(best.partition.bounds),
                "predicted": {
                    "step_time": best.step_time,
                    "bubble": best.bubble,
                    "rank_memory": list(best.rank_memory),
                    "rank_activation": list(best.rank_activation),
                },
            },
            indent=1,
        )


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
def _schedule(name: ScheduleName, n_stages: int, n_microbatches: int, n_virtual: int) -> Schedule:
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
    schedule = _schedule(option.schedule, n_stages, m, v)
    factor = workload.global_batch // dp // m / workload.profiled_batch
    ckpt = option.activation_checkpointing
    costs = _scaled(workload.costs, factor, ckpt, workload.input_bytes * factor)
    devices = cluster.stage_devices(pp, dp)
    fastest = max(d.flops for d in devices)
    recompute = max(c.saved_bytes for c in workload.costs) * factor if ckpt else 0.0
    smallest = min(d.memory for d in devices) / v
    if recompute >= smallest:
        return f"recomputing one layer needs {recompute / 2**30:.1f} GiB >= {smallest / 2**30:.1f} GiB per stage"
    # What the loss holds beyond the output-sized tensor _scaled counts as saved.
    loss_extra = 0.0 if workload.loss_bytes is None else max(0.0, workload.loss_bytes * factor - costs[-1].output_bytes)
    every = range(len(costs))
    last = _working(costs, every, recompute, loss_extra)
    transient = [_working(costs, every[:-1], recompute, 0.0)] * (n_stages - 1) + [last]  # only it has the last layer
    have = [devices[schedule.rank_of(s)].memory / v for s in range(n_stages)]
    why = _transient_error(transient, have, recompute, loss_extra)
    if why is not None:
        return why
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
        reason = f"stage {worst} needs {need} GiB > {cap} GiB (in the leanest split)"
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


_ONE_STAGE: ScheduleName = "1f1b"
"""What a single stage runs: with one stage every schedule is the same gradient accumulation."""
_VIRTUAL = 2
"""Stages per rank that a :attr:`~stagewise.schedule.Builder.virtual` (interleaved) schedule is tried with."""


def _layouts(pp: int, m: int) -> list[tuple[ScheduleName, int, bool]]:
    """(schedule, stages per rank, activation checkpointing) worth trying with ``pp`` ranks and ``m`` micro-batches:
    every built-in schedule that takes that shape (the builders say which run several stages per rank)."""
    out = []
    for name in get_args(ScheduleName):
        if pp == 1 and name != _ONE_STAGE:
            continue
        v = _VIRTUAL if BUILDERS[name].virtual else 1
        try:
            schedule = _schedule(name, pp * v, m, v)
        except ValueError:  # a shape the schedule cannot take (interleaved: m a multiple of pp)
            continue
        # A split backward (zero-bubble) does not combine with checkpointing: Pipeline refuses it.
        out += [(name, v, ckpt) for ckpt in ((False,) if schedule.splits_backward else (False, True))]
    return out


def candidates(n_devices: int, n_layers: int, global_batch: int, *, max_microbatches: int = 64) -> list[Option]:
    """Every layout worth simulating on ``n_devices``: pp x dp = n_devices, m, schedule, checkpointing."""
    out = []
    for pp in (d for d in range(1, n_devices + 1) if n_devices % d == 0 and d <= n_layers):
        dp = n_devices // pp
        local = global_batch // dp if global_batch % dp == 0 else 0
        top = min(local, max_microbatches)
        ms = [m for m in range(1, top + 1) if local % m == 0 and (m & (m - 1) == 0 or m == top)]
        for m in ms or [1]:
            out += [Option(pp, dp, v, m, name, ckpt) for name, v, ckpt in _layouts(pp, m)]
    return out


def plan(workload: Workload, cluster: Cluster, *, options: Sequence[Option] | None = None) -> Plan:
    """Evaluate every candidate layout (or ``options``) and rank the feasible ones by step time.

    Each candidate gets the exact partition under the devices' memory
    capacities and speeds (:func:`stagewise.partition.balance`), the step time
    of its schedule simulated with per-stage compute, the transfer of boundary
    activations over ``cluster.link_bandwidth``, DDP's ring all-reduce over
    ``cluster.network_bandwidth`` and the optimizer step, and the peak memory of
    every pipeline rank. A plan never proposes a layout whose predicted memory
    exceeds a device's capacity.
    """
    considered = list(options) if options is not None else candidates(
        cluster.n_devices, len(workload.costs), workload.global_batch
    )  # fmt: skip
    done = [evaluate(o, workload, cluster) for o in considered]
    feasible = sorted((o for o in done if o.rejected is None), key=lambda o: (o.step_time, max(o.rank_memory)))
    rejected = tuple(o for o in done if o.rejected is not None)
    smallest = None
    if not feasible:
        needs = [max(o.rank_memory) for o in rejected if o.rank_memory]
        smallest = min(needs) if needs else None
    log.info("planned %d layouts: %d fit", len(done), len(feasible))
    return Plan(tuple(feasible), rejected, smallest)


def load_plan(text: str) -> dict[str, Any]:
    """A plan written by :meth:`Plan.to_json`, checked for the fields ``train --plan`` needs."""
    data = json.loads(text)
    need = ("model", "stages", "dp", "virtual", "schedule", "microbatches", "batch_size", "partition")
    missing = [k for k in need if k not in data]
    if missing:
        raise ValueError(f"the plan lacks {missing}; write it with `stagewise plan --json`")
    return dict(data)
