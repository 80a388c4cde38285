"""A schedule synthesised for a planned layout's own stages, within the memory its built-in schedule holds."""

from __future__ import annotations

from stagewise.plan.cluster import Cluster
from stagewise.plan.evaluate import stage_costs
from stagewise.plan.option import Option
from stagewise.plan.setting import cached_schedule
from stagewise.plan.workload import Workload
from stagewise.schedule import peak_in_flight, synthesise
from stagewise.schedule.synthesis import Synthesis

MOST_RANKS = 16
MOST_MICROBATCHES = 64
"""The largest shape synthesised: what :func:`~stagewise.schedule.synthesise` finishes in seconds."""


def synthesised(option: Option, workload: Workload, cluster: Cluster) -> Synthesis | str:
    """A schedule synthesised for ``option``'s stages (its partition's simulated per-stage costs), each rank
    holding at most the micro-batches in flight that ``option``'s own schedule holds there, so the memory the
    plan checked still bounds it; or why none is.

    Only layouts of one stage per rank, without activation checkpointing (a split backward would recompute
    twice), up to :data:`MOST_RANKS` ranks and :data:`MOST_MICROBATCHES` micro-batches.
    """
    p, m = option.pp, option.n_microbatches
    if option.partition is None:
        return f"{option.describe()} has no partition: {option.rejected}"
    if p == 1:
        return "one stage: every schedule is the same gradient accumulation"
    if option.n_virtual != 1:
        return f"{option.n_virtual} stages per rank: the synthesiser keeps each rank within its memory per stage"
    if option.activation_checkpointing:
        return "activation checkpointing does not combine with a split backward"
    if p > MOST_RANKS or m > MOST_MICROBATCHES:
        return f"{p} ranks and {m} micro-batches: beyond {MOST_RANKS} ranks and {MOST_MICROBATCHES} micro-batches"
    held = peak_in_flight(cached_schedule(option.schedule, p, m, 1))
    return synthesise(stage_costs(option, workload, cluster), p, m, limit=[held[s] for s in range(p)])
