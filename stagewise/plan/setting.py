"""One layout made concrete: its schedule, its layers' costs at its micro-batch size on one rank, its devices."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from dataclasses import dataclass

from stagewise.partition import LayerCost, MemoryModel, memory_model
from stagewise.partition.auto import params_of
from stagewise.partition.layers import SharedParameter
from stagewise.plan.cluster import Cluster, Device
from stagewise.plan.option import Option
from stagewise.plan.rank_memory import state_multiplier, working
from stagewise.plan.rejection import Rejection, recompute_rejection, shape_rejection, transient_rejection
from stagewise.plan.tensor_parallel import collective_seconds, split_costs, split_ties
from stagewise.plan.time_model import layer_times
from stagewise.plan.workload import Workload
from stagewise.schedule import Schedule, ScheduleName, build, holdings, peak_in_flight
from stagewise.schedule.holdings import FREE, Holding


@functools.lru_cache(maxsize=1024)
def cached_schedule(name: ScheduleName, n_stages: int, n_microbatches: int, n_virtual: int) -> Schedule:
    """:func:`~stagewise.schedule.build`, once per shape: the candidates and their settings ask for the same."""
    return build(name, n_stages, n_microbatches, n_virtual=n_virtual)


@functools.lru_cache(maxsize=1024)
def cached_holdings(
    name: ScheduleName, n_stages: int, n_microbatches: int, n_virtual: int, checkpointing: bool, pooled: bool
) -> tuple[tuple[Holding, ...], ...]:
    """:func:`~stagewise.schedule.holdings` of a built-in schedule, once per shape: layouts that differ only in
    their data-parallel and sharded dimensions share it. ``pooled``: with Pipeline's default weight-gradient
    pool; sharded stages have none (their gradients accumulate through autograd)."""
    schedule = cached_schedule(name, n_stages, n_microbatches, n_virtual)
    return holdings(schedule, FREE if pooled else None, checkpointing=checkpointing)


@dataclass(frozen=True)
class ScheduleShape:
    """What the search's bounds need of a built-in schedule."""

    peaks: tuple[int, ...]
    """Per stage: the most micro-batches it holds in flight (:func:`~stagewise.schedule.peak_in_flight`)."""
    splits: bool
    """Whether its backward runs as I then W."""


@functools.lru_cache(maxsize=1024)
def cached_shape(name: ScheduleName, n_stages: int, n_microbatches: int, n_virtual: int) -> ScheduleShape:
    """The :class:`ScheduleShape` of a built-in schedule, once per shape."""
    schedule = cached_schedule(name, n_stages, n_microbatches, n_virtual)
    return ScheduleShape(peak_in_flight(schedule), schedule.splits_backward)


def clear_caches() -> None:
    """Forget the schedules built and what was worked out of them, as a fresh process starts (for timing a search)."""
    for cache in (cached_schedule, cached_holdings, cached_shape):
        cache.cache_clear()


def scaled(costs: Sequence[LayerCost], factor: float, checkpointing: bool, input_bytes: float) -> list[LayerCost]:
    """Costs of a micro-batch ``factor`` times the profiled one; with checkpointing, only layer inputs are kept.

    The last layer also holds what the loss saves for backward, taken as one
    tensor the size of the model's output (cross-entropy keeps its
    log-softmax, a squared error its difference); what else the loss holds
    while it runs (:attr:`Workload.loss_bytes`) is the last stage's working memory (:attr:`Layers.working`).
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


@dataclass(frozen=True)
class Layers:
    """A workload's layers at one micro-batch size, on one of ``tp`` ranks, timed on one device speed."""

    costs: list[LayerCost]
    seconds: list[tuple[float, float]]
    """Per layer: forward and backward seconds on the fastest device, with tensor parallelism's collectives
    (backward includes recomputation, and a recomputed forward repeats its collectives)."""
    shared: tuple[SharedParameter, ...]
    """The tied parameters, each its bytes on one rank (a tensor-parallel shard where its layers split)."""
    recompute: float
    """Bytes of one layer's activations recomputed at once under activation checkpointing."""
    loss_extra: float
    """Bytes the loss holds beyond the output-sized tensor counted as saved, on the last stage."""
    working: tuple[float, float]
    """What computing one micro-batch holds on top of the memory model (see
    :func:`~stagewise.plan.rank_memory.working`), whichever layers a stage gets: on a stage without the last layer,
    and on the last stage."""

    @functools.cached_property
    def param_bytes(self) -> int:
        """The parameter bytes of every layer on one rank, each tied parameter once."""
        return params_of(self.costs, self.shared, range(len(self.costs)), nbytes=True)


@dataclass(frozen=True)
class Setting:
    """One option made concrete: its schedule, per-layer costs at its micro-batch size, and its devices."""

    option: Option
    schedule: Schedule
    devices: list[Device]
    """Per pipeline rank: the weakest device among its replicas."""
    layers: Layers
    speeds: list[float]
    """Per stage: its device's speed relative to the fastest."""
    capacities: list[float]
    """Per stage: the bytes its memory model may take (its share of its device, less :attr:`transient`)."""
    transient: list[float]
    """Per stage, at most: bytes it holds on top of its memory model while it computes one micro-batch, whichever
    layers it gets; what the partition must leave free."""
    state: float
    """Copies of each parameter a rank holds at its fullest (:func:`~stagewise.plan.rank_memory.state_multiplier`)."""

    @property
    def costs(self) -> list[LayerCost]:
        return self.layers.costs

    @property
    def seconds(self) -> list[tuple[float, float]]:
        return self.layers.seconds

    @functools.cached_property
    def memory(self) -> MemoryModel:
        """What the schedule's own actions hold, with Pipeline's default weight-gradient pool."""
        o = self.option
        tp, ckpt = o.tp, o.activation_checkpointing
        return memory_model(
            self.costs,
            schedule=self.schedule,
            holdings=cached_holdings(
                o.schedule, self.schedule.n_stages, o.n_microbatches, o.n_virtual, ckpt, o.fsdp == 1 and tp == 1
            ),
            state_multiplier=self.state,
            shared=self.layers.shared,
        )


class Settings:
    """The settings of one workload's layouts on one cluster: layouts of the same micro-batch size, tensor-parallel
    degree and device speed share their layers' costs."""

    def __init__(self, workload: Workload, cluster: Cluster) -> None:
        self.workload = workload
        self.cluster = cluster
        self._layers: dict[tuple[float, bool, int, float], Layers] = {}

    def of(self, option: Option) -> Setting | Rejection:
        """The concrete setting of ``option``, or why it cannot run."""
        workload, cluster = self.workload, self.cluster
        why = shape_rejection(option, workload, cluster)
        if why is not None:
            return why
        pp, v, m = option.pp, option.n_virtual, option.n_microbatches
        n_stages = pp * v
        schedule = cached_schedule(option.schedule, n_stages, m, v)
        factor = workload.global_batch // option.batch_shards // m / workload.profiled_batch
        devices = cluster.stage_devices(pp, option.ranks_per_stage)
        fastest = max(d.flops for d in devices)
        layers = self._layers_of(factor, option.activation_checkpointing, option.tp, fastest)
        why = recompute_rejection(layers.recompute, min(d.memory for d in devices) / v, v)
        if why is not None:
            return why
        transient = [layers.working[0]] * (n_stages - 1) + [layers.working[1]]  # only the last has the last layer
        have = [devices[schedule.rank_of(s)].memory / v for s in range(n_stages)]
        why = transient_rejection(transient, have, layers.recompute, layers.loss_extra, v)
        if why is not None:
            return why
        return Setting(
            option=option,
            schedule=schedule,
            devices=devices,
            layers=layers,
            speeds=[devices[schedule.rank_of(s)].flops / fastest for s in range(n_stages)],
            capacities=[own - t for own, t in zip(have, transient, strict=True)],
            transient=transient,
            state=state_multiplier(workload.state_multiplier, option.fsdp),
        )

    def _layers_of(self, factor: float, checkpointing: bool, tp: int, fastest: float) -> Layers:
        """The workload's layers at ``factor`` times the profiled micro-batch, on one of ``tp`` ranks, timed on a
        device of ``fastest`` FLOP/s; once per such shape."""
        key = (factor, checkpointing, tp, fastest)
        found = self._layers.get(key)
        if found is None:
            found = self._layers[key] = self._measure(factor, checkpointing, tp, fastest)
        return found

    def _measure(self, factor: float, ckpt: bool, tp: int, fastest: float) -> Layers:
        workload = self.workload
        found = workload.traffic(tp) if tp > 1 else None
        traffic = found if not isinstance(found, str) else None  # a refusal was shape_rejection's
        input_bytes = workload.input_bytes * factor
        costs = split_costs(scaled(workload.costs, factor, ckpt, input_bytes), traffic, tp)
        recompute = max(c.saved_bytes for c in workload.costs) * factor if ckpt else 0.0
        # What the loss holds beyond the output-sized tensor scaled() counts as saved.
        loss_bytes = workload.loss_bytes
        loss_extra = 0.0 if loss_bytes is None else max(0.0, loss_bytes * factor - costs[-1].output_bytes)
        every = range(len(costs))
        loss_f, loss_b = workload.loss_seconds
        collectives = collective_seconds(costs, traffic, tp, self.cluster, input_bytes)
        computed = layer_times(costs, fastest, ckpt, (loss_f * factor, loss_b * factor))
        return Layers(
            costs=costs,
            # A recomputed forward repeats its collectives.
            seconds=[
                (f + cf, b + cb + (cf if ckpt else 0.0)) for (f, b), (cf, cb) in zip(computed, collectives, strict=True)
            ],
            shared=split_ties(workload.shared, traffic, tp),
            recompute=recompute,
            loss_extra=loss_extra,
            working=(working(costs, every[:-1], recompute, 0.0), working(costs, every, recompute, loss_extra)),
        )
