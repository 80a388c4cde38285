"""plan(): the fastest layout that fits — pipeline depth, data parallelism, micro-batches, schedule, checkpointing."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence
from dataclasses import dataclass

from stagewise.plan.cluster import Cluster
from stagewise.plan.evaluate import evaluate
from stagewise.plan.option import GATHERS, Checkpointing, Gather, Option, Plan
from stagewise.plan.search import search
from stagewise.plan.workload import Workload
from stagewise.schedule import ScheduleName
from stagewise.schedule.builders import BUILDERS

log = logging.getLogger(__name__)


_ONE_STAGE: ScheduleName = "1f1b"
"""What a single stage runs: with one stage every schedule is the same gradient accumulation."""
_VIRTUAL = 2
"""Stages per rank that a :attr:`~stagewise.schedule.Builder.virtual` (interleaved) schedule is tried with."""


SEARCHED: tuple[ScheduleName, ...] = (
    "gpipe", "1f1b", "interleaved-1f1b", "looped-bfs", "zero-bubble", "zbv", "dualpipev",
)  # fmt: skip
"""The built-in schedules the planner tries: every one :func:`~stagewise.schedule.build` knows."""

CHECKPOINTING: tuple[Checkpointing, ...] = (False, True, "selective")
"""The activation checkpointing each layout is tried with."""


@dataclass(frozen=True)
class Layout:
    """A schedule worth trying for a pipeline shape."""

    schedule: ScheduleName
    n_virtual: int
    """Stages per rank."""


def _layouts(pp: int, m: int) -> list[Layout]:
    """The schedules worth trying with ``pp`` ranks and ``m`` micro-batches: every one of :data:`SEARCHED` that
    takes that shape (the builders say which run several stages per rank)."""
    out = []
    for name in SEARCHED:
        if pp == 1 and name != _ONE_STAGE:
            continue
        builder = BUILDERS[name]
        v = _VIRTUAL if builder.virtual else 1
        # Shapes a schedule cannot take (interleaved: m a multiple of pp; DualPipeV: m >= 2 pp), told by its
        # builder without building it.
        if (builder.whole_rounds and m % pp) or m < builder.least_rounds * pp:
            continue
        out.append(Layout(name, v))
    return out


@dataclass(frozen=True)
class MemoryChoice:
    """One combination of the memory options a layout is tried with."""

    checkpointing: Checkpointing
    gather: Gather = "step"
    offload_optimizer: bool = False
    offload_activations: bool = False


def memory_choices(fsdp: int, n_virtual: int, *, host: bool) -> list[MemoryChoice]:
    """The memory options worth trying for a layout of ``fsdp`` shards and ``n_virtual`` stages per rank.

    FSDP gathers per micro-batch only with ``fsdp > 1`` and several stages per rank (with one, it holds as much
    at its fullest as gathering once a step: :func:`~stagewise.plan.rank_memory.whole_copies`). Offloading only
    where the host is described (``host``); activations not under whole-layer checkpointing, which keeps only
    each layer's input.
    """
    gathers: tuple[Gather, ...] = GATHERS if fsdp > 1 and n_virtual > 1 else ("step",)
    flags = (False, True) if host else (False,)
    return [
        MemoryChoice(ckpt, gather, opt, act)
        for ckpt in CHECKPOINTING
        for gather in gathers
        for opt in flags
        for act in flags
        if not (act and ckpt is True)
    ]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _data_parallel(ranks: int, tp: int, gpus_per_node: int) -> list[tuple[int, int]]:
    """(dp, fsdp) pairs worth trying for ``ranks`` data-parallel ranks of a stage: replicas alone (DDP), shards
    alone (FSDP over them all), and HSDP sharded within a node (``gpus_per_node / tp`` shards)."""
    pairs = {(ranks, 1), (1, ranks)}
    within = gpus_per_node // tp
    if 1 < within < ranks and ranks % within == 0:
        pairs.add((ranks // within, within))
    return sorted(pairs)


def _microbatches(local: int, most: int, *, least: int = 1) -> list[int]:
    """Micro-batch counts that divide ``local``: powers of two from ``least``, and the largest up to ``most``."""
    top = min(local, most)
    ms = [m for m in range(1, top + 1) if local % m == 0 and (m & (m - 1) == 0 or m == top) and m >= least]
    return ms or [top if local % top == 0 and top >= 1 else 1]


def expert_degrees(dp: int, fsdp: int, experts: int) -> list[int]:
    """The expert-parallel degrees worth trying with ``dp`` replicas of ``fsdp`` shards and MoE layers of
    ``experts`` routed experts (0: none, so 1 alone): every divisor of the dimension ep borrows from (fsdp, or dp
    with fsdp = 1, :attr:`stagewise.comm.Layout.ep`) that divides the experts too."""
    if not experts:
        return [1]
    return [ep for ep in _divisors(fsdp if fsdp > 1 else dp) if experts % ep == 0]


def candidates(
    n_devices: int,
    n_layers: int,
    global_batch: int,
    *,
    max_microbatches: int = 128,
    tp_degrees: Sequence[int] = (),
    gpus_per_node: int = 8,
    host: bool = False,
    experts: int = 0,
) -> list[Option]:
    """Every layout worth simulating on ``n_devices``: pp x dp x fsdp x tp = n_devices, m, schedule, and the
    memory options (:func:`memory_choices`; offloading with ``host``, where the cluster describes its host), and
    for a model with mixture-of-experts layers of ``experts`` routed experts, each expert-parallel degree
    (:func:`expert_degrees`).

    ``tp_degrees``: the tensor-parallel degrees the model's plan can take (each dividing ``gpus_per_node``, so a
    group stays within a node). Sharded layouts (fsdp or tp above 1) are tried with at least ``pp`` micro-batches
    (fewer only lengthen the bubble and keep no less in flight) and without GPipe (1F1B's time, more in flight).
    """
    out = []
    tps = [1, *(t for t in tp_degrees if t > 1 and n_devices % t == 0 and gpus_per_node % t == 0)]
    for tp in tps:
        for pp in (d for d in _divisors(n_devices // tp) if d <= n_layers):
            ranks = n_devices // (pp * tp)
            for dp, fsdp in _data_parallel(ranks, tp, gpus_per_node):
                sharded = fsdp > 1 or tp > 1
                if global_batch % ranks:
                    ms = [1]
                else:
                    ms = _microbatches(global_batch // ranks, max_microbatches, least=pp if sharded else 1)
                for m, ep in itertools.product(ms, expert_degrees(dp, fsdp, experts)):
                    out += [
                        Option(
                            pp,
                            dp,
                            layout.n_virtual,
                            m,
                            layout.schedule,
                            choice.checkpointing,
                            fsdp=fsdp,
                            tp=tp,
                            fsdp_gather=choice.gather,
                            offload_optimizer=choice.offload_optimizer,
                            offload_activations=choice.offload_activations,
                            ep=ep,
                        )
                        for layout in _layouts(pp, m)
                        if not (sharded and layout.schedule == "gpipe")
                        for choice in memory_choices(fsdp, layout.n_virtual, host=host)
                    ]
    return out


def tensor_parallel_degrees(workload: Workload) -> list[int]:
    """The tensor-parallel degrees ``workload``'s model can be split over (its plan takes them)."""
    return [tp for tp, traffic in workload.tensor_parallel if not isinstance(traffic, str)]


def plan(
    workload: Workload, cluster: Cluster, *, options: Sequence[Option] | None = None, top: int | None = None
) -> Plan:
    """Evaluate every candidate layout (or ``options``) and rank the feasible ones by step time.

    Each candidate gets the exact partition under the devices' memory
    capacities and speeds (:func:`stagewise.partition.balance`), the step time
    of its schedule simulated with per-stage compute, the transfer of boundary
    activations over ``cluster.link_bandwidth``, tensor parallelism's
    collectives per micro-batch within a node, DDP's all-reduce or FSDP's
    all-gather and reduce-scatter once per step (within a node or across, as
    their group spans) and the optimizer step, and the peak memory of every
    pipeline rank. A plan never proposes a layout whose predicted memory
    exceeds a device's capacity.

    With ``top``, only the ``top`` fastest are wanted: :attr:`Plan.options` holds them, with the same figures and
    in the same order as the whole search, and a layout that cannot be among them (a lower bound of its step time
    is slower than the ``top``-th found, or no split of its stages fits the memory) is not evaluated but counted
    in :attr:`Plan.unranked`, so :attr:`Plan.rejected` lists only the layouts evaluated. Where none fits, every
    layout is evaluated, as without ``top``.
    """
    considered = list(options) if options is not None else candidates(
        cluster.n_devices, len(workload.costs), workload.global_batch, tp_degrees=tensor_parallel_degrees(workload),
        gpus_per_node=cluster.gpus_per_node, host=cluster.offloads, experts=workload.expert_counts,
    )  # fmt: skip
    if top is not None:
        found = search(considered, workload, cluster, top)
        feasible, rejected, unranked = list(found.fastest), found.rejected, found.unranked
    else:
        done = [evaluate(o, workload, cluster) for o in considered]
        feasible = sorted((o for o in done if o.rejected is None), key=lambda o: (o.step_time, max(o.rank_memory)))
        rejected, unranked = tuple(o for o in done if o.rejected is not None), ()
    smallest = None
    if not feasible:
        needs = [max(o.rank_memory) for o in rejected if o.rank_memory]
        smallest = min(needs) if needs else None
    log.info("planned %d layouts: %d fit", len(considered), len(feasible))
    return Plan(tuple(feasible), rejected, smallest, unranked)
