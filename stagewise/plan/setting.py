"""One layout made concrete: its schedule, its layers' costs at its micro-batch size on one rank, its devices."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from stagewise.partition import LayerCost, MemoryModel, memory_model
from stagewise.partition.auto import params_of
from stagewise.partition.layers import SharedParameter
from stagewise.partition.memory import split_waiting_bytes
from stagewise.plan.cluster import Cluster, Device
from stagewise.plan.expert_cost import dense_costs, rank_experts, with_experts
from stagewise.plan.option import Checkpointing, Option
from stagewise.plan.rank_memory import OFFLOADED_IN_FLIGHT, host_multiplier, offloaded, state_multiplier, working
from stagewise.plan.rejection import Rejection, recompute_rejection, shape_rejection, transient_rejection
from stagewise.plan.tensor_parallel import collective_seconds, split_costs, split_ties
from stagewise.plan.time_model import (
    Overlapped,
    action_seconds,
    expert_collectives,
    gather_seconds,
    layer_seconds,
    recompute_seconds,
)
from stagewise.plan.workload import Workload
from stagewise.schedule import Schedule, ScheduleName, SharedCores, build, holdings, peak_in_flight
from stagewise.schedule.builders import BUILDERS
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


@functools.lru_cache(maxsize=1024)
def stage_ranks(name: ScheduleName, n_ranks: int, n_virtual: int) -> tuple[int, ...]:
    """Per stage: the rank a built-in schedule places it on (its :attr:`~stagewise.schedule.Builder.placement`,
    else round robin), without building the schedule."""
    placement = BUILDERS[name].placement
    if placement is not None:
        return placement(n_ranks)
    return tuple(s % n_ranks for s in range(n_ranks * n_virtual))


@functools.lru_cache(maxsize=64)
def splits_backward(name: ScheduleName, n_virtual: int) -> bool:
    """Whether the built-in schedule ``name`` splits its backward into I and W (read off a small one it builds:
    two ranks of ``n_virtual`` stages, four micro-batches)."""
    return build(name, 2 * n_virtual, 4, n_virtual=n_virtual).splits_backward


def clear_caches() -> None:
    """Forget the schedules built and what was worked out of them, as a fresh process starts (for timing a search)."""
    for cache in (cached_schedule, cached_holdings, cached_shape, stage_ranks, splits_backward):
        cache.cache_clear()


def scaled(
    costs: Sequence[LayerCost], factor: float, checkpointing: Checkpointing, input_bytes: float
) -> list[LayerCost]:
    """Costs of a micro-batch ``factor`` times the profiled one; with checkpointing, only layer inputs are kept
    (and, selective, the outputs of its matmuls and fused attention, :attr:`LayerCost.selective_bytes`), and no
    pooled linear's input is among them (:attr:`LayerCost.pooled_input_bytes` 0: a split backward keeps its own).

    The last layer also holds what the loss saves for backward, taken as one
    tensor the size of the model's output (cross-entropy keeps its
    log-softmax, a squared error its difference), and the output itself:
    ``Pipeline`` keeps each forward's output until its backward (B, or a
    split backward's W) lets it go (:func:`held_output`). What else the loss
    holds while it runs (:attr:`Workload.loss_bytes`) is the last stage's
    working memory (:attr:`Layers.working`).
    """
    out = []
    previous = input_bytes
    for index, c in enumerate(costs):
        if checkpointing == "selective":
            saved = previous + c.selective_bytes * factor
        else:
            saved = previous if checkpointing else c.saved_bytes * factor
        if index == len(costs) - 1:
            saved += c.output_bytes * factor  # the loss keeps a tensor the size of the output (log-softmax, error)
            saved += held_output(c, factor, checkpointing)
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
                flush_bytes=int(c.flush_bytes * factor),
                use_bytes=int(c.use_bytes * factor),
                pooled_input_bytes=0 if checkpointing else int(c.pooled_input_bytes * factor),
                working_bytes=int(c.working_bytes * factor),
                selective_bytes=int(c.selective_bytes * factor),
                recompute_flops=int(c.recompute_flops * factor),
                recompute_bytes=int(c.recompute_bytes * factor),
                checkpoint_flops=None if c.checkpoint_flops is None else int(c.checkpoint_flops * factor),
                recompute_time=None if c.recompute_time is None else c.recompute_time * factor,
            )
        )
        previous = c.output_bytes * factor
    return out


def held_output(last: LayerCost, factor: float, checkpointing: Checkpointing) -> float:
    """Bytes of the model's output (the last layer's, profiled ``last``) for a micro-batch ``factor`` times the
    profiled one that ``Pipeline`` holds from the forward until its backward lets it go, beyond what the layer
    saves of it: under selective checkpointing the output of a matmul (a language model's head, whose logits
    the loss reads) is what selective checkpointing keeps of that layer, one storage counted once."""
    kept = min(last.selective_bytes, last.output_bytes) if checkpointing == "selective" else 0
    return float((last.output_bytes - kept) * factor)


def loss_beyond(loss_bytes: int | None, factor: float, last: LayerCost, checkpointing: Checkpointing) -> float:
    """Bytes the loss holds while it runs beyond what the last layer's saved bytes count (``last`` as
    :func:`scaled` made it, for a micro-batch ``factor`` times the profiled one): its measured bytes
    (:attr:`Workload.loss_bytes`, the model's output included) less the output-sized tensor :func:`scaled` counts
    as saved and less the output itself, which the pipeline holds until the backward (:func:`held_output`; under
    selective checkpointing the layer's own kept output, the same storage). ``checkpointing`` does not change it
    (the output is counted once either way). None known: 0."""
    del checkpointing  # the held output and selective checkpointing's kept output are one storage
    if loss_bytes is None:
        return 0.0
    return max(0.0, loss_bytes * factor - 2 * last.output_bytes)


@dataclass(frozen=True)
class RangeSums:
    """What every range of a workload's layers holds, ``[start, stop]`` the sum over layers ``start:stop``: what
    the search's fit test (:func:`~stagewise.plan.bounds.can_fit`) costs each possible stage with."""

    params: np.ndarray
    """Parameter bytes, a tied parameter's left out (times the copies a rank keeps of each: its state)."""
    buffers: np.ndarray
    kept: np.ndarray
    """Saved activation bytes of one micro-batch, a tensor two neighbours save left out."""
    pooled: np.ndarray
    """Bytes a micro-batch waiting for a split backward's W keeps
    (:func:`~stagewise.partition.memory.split_waiting_bytes`)."""
    ahead: np.ndarray
    """Where ``stop > start``: no stage is empty."""
    param_scale: float
    scale: float
    """Magnitudes of the sums (parameters, the rest), for a tolerance of rounding."""

    @classmethod
    def of(cls, costs: Sequence[LayerCost], shared: Sequence[SharedParameter]) -> RangeSums:
        params = np.array([float(c.param_bytes) for c in costs], dtype=np.float64)
        for tie in shared:
            params[list(tie.indices)] -= tie.nbytes
        buffers = np.array([float(c.buffer_bytes) for c in costs], dtype=np.float64)
        kept = np.array([float(c.saved_bytes) - float(c.shared_bytes) for c in costs], dtype=np.float64)
        pooled = np.array([float(split_waiting_bytes(c)) for c in costs], dtype=np.float64)

        def ranges(values: np.ndarray) -> np.ndarray:
            sums = np.concatenate(([0.0], np.cumsum(values)))
            return np.asarray(sums[None, :] - sums[:, None])

        ahead = np.triu(np.ones((len(costs) + 1, len(costs) + 1), dtype=bool), k=1)
        rest = float(np.abs(buffers).sum() + np.abs(kept).sum() + np.abs(pooled).sum())
        return cls(ranges(params), ranges(buffers), ranges(kept), ranges(pooled), ahead, float(np.abs(params).sum()),
                   rest)  # fmt: skip


@dataclass(frozen=True)
class Layers:
    """A workload's layers at one micro-batch size, on one of ``tp`` ranks, timed on one device speed."""

    costs: list[LayerCost]
    seconds: list[tuple[float, float]]
    """Per layer: forward and backward seconds on the fastest device, with tensor parallelism's collectives
    (backward includes recomputation, and a recomputed forward repeats its collectives) and what is exposed of
    FSDP's per-action collectives and activation offloading (:func:`~stagewise.plan.time_model.action_seconds`)."""
    split: list[tuple[float, float]]
    """Per layer: the seconds of a split backward's I and W, each with its recomputation."""
    shared: tuple[SharedParameter, ...]
    """The tied parameters, each its bytes on one rank (a tensor-parallel shard where its layers split)."""
    recompute: float
    """Bytes of one layer's activations recomputed at once under activation checkpointing (selective: those it
    does not keep)."""
    loss_extra: float
    """Bytes the loss holds beyond the output-sized tensor counted as saved, on the last stage."""
    working: tuple[float, float]
    """What computing one micro-batch holds on top of the memory model (see
    :func:`~stagewise.plan.rank_memory.working`), whichever layers a stage gets: on a stage without the last layer,
    and on the last stage."""
    expert_bytes: tuple[float, ...] = ()
    """Per layer: the bytes of the routed experts' parameters a rank holds (its ``1/ep`` share, which FSDP does not
    shard; in :attr:`costs` their state is counted with the buffers, not in ``param_bytes``); empty without
    experts."""

    @functools.cached_property
    def range_sums(self) -> RangeSums:
        """What every range of the layers holds (:class:`RangeSums`)."""
        return RangeSums.of(self.costs, self.shared)

    @functools.cached_property
    def param_bytes(self) -> int:
        """The parameter bytes of every layer on one rank, each tied parameter once."""
        return params_of(self.costs, self.shared, range(len(self.costs)), nbytes=True)


@dataclass(frozen=True)
class Setting:
    """One option made concrete: its schedule, per-layer costs at its micro-batch size, and its devices."""

    option: Option
    placement: tuple[int, ...]
    """Per stage: the pipeline rank that runs it (the schedule's, known before it is built)."""
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
    host_state: float = 0.0
    """Copies of each parameter a rank keeps in host memory (:func:`~stagewise.plan.rank_memory.host_multiplier`)."""
    cores: SharedCores | None = None
    """How the ranks share a machine's CPU cores (:attr:`Cluster.host_cores`); None: each computes on its own."""

    @functools.cached_property
    def peaks(self) -> tuple[int, ...]:
        """Per stage: the most micro-batches whose saved activations it holds on the device."""
        peaks = cached_shape(self.option.schedule, self.n_stages, self.option.n_microbatches,
                             self.option.n_virtual).peaks  # fmt: skip
        return tuple(min(p, OFFLOADED_IN_FLIGHT) for p in peaks) if self.option.offload_activations else peaks

    @property
    def costs(self) -> list[LayerCost]:
        return self.layers.costs

    @property
    def n_stages(self) -> int:
        return len(self.placement)

    @functools.cached_property
    def schedule(self) -> Schedule:
        """The option's built schedule, built when first asked for (a search rules most layouts out before)."""
        o = self.option
        return cached_schedule(o.schedule, self.n_stages, o.n_microbatches, o.n_virtual)

    @property
    def seconds(self) -> list[tuple[float, float]]:
        return self.layers.seconds

    @functools.cached_property
    def memory(self) -> MemoryModel:
        """What the schedule's own actions hold, with Pipeline's default weight-gradient pool."""
        o = self.option
        ckpt = o.activation_checkpointing is not False
        pooled = o.fsdp == 1 and o.tp == 1 and not o.offload_activations and not o.offload_optimizer
        moments = cached_holdings(o.schedule, self.n_stages, o.n_microbatches, o.n_virtual, ckpt, pooled)
        return memory_model(
            self.costs,
            schedule=self.schedule,
            holdings=offloaded(moments) if o.offload_activations else moments,
            state_multiplier=self.state,
            shared=self.layers.shared,
        )


def _again(cost: LayerCost, device: Device, checkpointing: Checkpointing) -> float | None:
    """Seconds of ``cost``'s recomputation under ``checkpointing``; None without it."""
    return None if checkpointing is False else recompute_seconds(cost, device, checkpointing)


class Settings:
    """The settings of one workload's layouts on one cluster: layouts of the same micro-batch size, tensor-parallel
    degree and device speed share their layers' costs."""

    def __init__(self, workload: Workload, cluster: Cluster) -> None:
        self.workload = workload
        self.cluster = cluster
        self._layers: dict[tuple[Any, ...], Layers] = {}
        self._dense = dense_costs(workload.costs, workload.experts)

    def of(self, option: Option) -> Setting | Rejection:
        """The concrete setting of ``option``, or why it cannot run."""
        workload, cluster = self.workload, self.cluster
        why = shape_rejection(option, workload, cluster)
        if why is not None:
            return why
        pp, v, m = option.pp, option.n_virtual, option.n_microbatches
        n_stages = pp * v
        placement = stage_ranks(option.schedule, pp, v)
        factor = workload.global_batch // option.batch_shards // m / workload.profiled_batch
        devices = cluster.stage_devices(pp, option.ranks_per_stage)
        fastest = Device(
            memory=min(d.memory for d in devices),
            flops=max(d.flops for d in devices),
            memory_bandwidth=max(d.memory_bandwidth for d in devices),
        )
        layers = self._layers_of(factor, option, fastest)
        why = recompute_rejection(layers.recompute, min(d.memory for d in devices) / v, v)
        if why is not None:
            return why
        transient = [layers.working[0]] * (n_stages - 1) + [layers.working[1]]  # only the last has the last layer
        have = [devices[placement[s]].memory / v for s in range(n_stages)]
        why = transient_rejection(transient, have, layers.recompute, layers.loss_extra, v)
        if why is not None:
            return why
        return Setting(
            option=option,
            placement=placement,
            devices=devices,
            layers=layers,
            speeds=[devices[placement[s]].flops / fastest.flops for s in range(n_stages)],
            capacities=[own - t for own, t in zip(have, transient, strict=True)],
            transient=transient,
            state=state_multiplier(workload.state_multiplier, option),
            host_state=host_multiplier(workload.state_multiplier, option),
            cores=None
            if cluster.host_cores is None
            else SharedCores(cluster.host_cores, option.ranks_per_stage, workload.profiled_processes),
        )

    def _layers_of(self, factor: float, option: Option, fastest: Device) -> Layers:
        """The workload's layers at ``factor`` times the profiled micro-batch under ``option``'s checkpointing,
        tensor parallelism, FSDP gathering and offloading, timed on a device as fast as ``fastest``; once per
        such shape."""
        gathers = option.fsdp if option.fsdp_gather == "micro-batch" else 1
        key = (factor, option.activation_checkpointing, option.tp, gathers, option.offload_activations, fastest,
               option.ep)  # fmt: skip
        found = self._layers.get(key)
        if found is None:
            found = self._layers[key] = self._measure(factor, option, fastest)
        return found

    def _measure(self, factor: float, option: Option, fastest: Device) -> Layers:
        workload, cluster = self.workload, self.cluster
        ckpt, tp = option.activation_checkpointing, option.tp
        found = workload.traffic(tp) if tp > 1 else None
        traffic = found if not isinstance(found, str) else None  # a refusal was shape_rejection's
        input_bytes = workload.input_bytes * factor
        costs = split_costs(scaled(self._dense, factor, ckpt, input_bytes), traffic, tp)
        experts = rank_experts(
            workload.experts, len(costs), factor, option.ep, workload.expert_imbalance, workload.state_multiplier
        )
        costs = [c if e is None else with_experts(c, e, ckpt) for c, e in zip(costs, experts, strict=True)]
        if ckpt == "selective":
            recompute = max(c.saved_bytes - c.selective_bytes for c in workload.costs) * factor
        else:
            recompute = max(c.saved_bytes for c in workload.costs) * factor if ckpt else 0.0
        loss_extra = loss_beyond(workload.loss_bytes, factor, costs[-1], ckpt)
        every = range(len(costs))
        loss_f, loss_b = workload.loss_seconds
        collectives = collective_seconds(costs, traffic, tp, cluster, input_bytes)
        collectives = [
            pair if e is None else expert_collectives(pair, e, option, cluster)
            for pair, e in zip(collectives, experts, strict=True)
        ]
        host = cluster.host_bandwidth if option.offload_activations and cluster.host_bandwidth else None
        actions = []
        for index, (c, pair) in enumerate(zip(costs, collectives, strict=True)):
            f, b = layer_seconds(c, fastest.flops)
            if index == len(costs) - 1:  # the last layer also runs the loss
                f, b = f + loss_f * factor, b + loss_b * factor
            gather = gather_seconds(c.param_bytes, option, cluster)
            moved = Overlapped(gather, gather, 0.0 if host is None else c.saved_bytes / host)
            actions.append(action_seconds((f, b), pair, _again(c, fastest, ckpt), moved, cluster.side_stream))
        return Layers(
            costs=costs,
            seconds=[(a.forward, a.backward) for a in actions],
            split=[(a.input_grad, a.weight_grad) for a in actions],
            shared=split_ties(workload.shared, traffic, tp),
            recompute=recompute,
            loss_extra=loss_extra,
            working=(working(costs, every[:-1], recompute, 0.0), working(costs, every, recompute, loss_extra)),
            expert_bytes=tuple(0.0 if e is None else e.param_bytes for e in experts) if workload.experts else (),
        )
