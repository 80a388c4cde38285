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

    With several stages per rank, each rank holds at most the fewest that any of its stages holds under
    ``option``'s schedule (the synthesiser bounds a rank's stages alike), so each stage stays within what the plan
    checked. The stage costs price a split backward's recomputation twice (I, then W), so a synthesised split
    backward is costed as checkpointing runs it. Up to :data:`MOST_RANKS` ranks and :data:`MOST_MICROBATCHES`
    micro-batches.
    """
    p, m = option.pp, option.n_microbatches
    if option.partition is None:
        return f"{option.describe()} has no partition: {option.rejected}"
    if p == 1:
        return "one stage: every schedule is the same gradient accumulation"
    if p > MOST_RANKS or m > MOST_MICROBATCHES:
        return f"{p} ranks and {m} micro-batches: beyond {MOST_RANKS} ranks and {MOST_MICROBATCHES} micro-batches"
    v = option.n_virtual
    schedule = cached_schedule(option.schedule, p * v, m, v)
    held = peak_in_flight(schedule)
    limit = [min(held[s] for s in schedule.stages_of(r)) for r in range(p)]
    return synthesise(stage_costs(option, workload, cluster), p, m, limit=limit)
