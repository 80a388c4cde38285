"""synthesise(): a schedule built for measured stage times and each rank's memory limit, no slower than a builtin.

The built-in schedules assume equal stages; a real partition is not (the embedding's stage, the loss's). This search
list-schedules the actions for the measured F, B, I and W times and transfer times
(:func:`~stagewise.schedule.list_scheduling.list_schedule`) over the choices that matter: the placement (round
robin, or the V where each rank holds 2 stages), the backward whole or split into I and W, and the tie-break. It
also considers every built-in schedule of the same shape. Every candidate that validates and keeps each stage within its
rank's limit of micro-batches in flight is simulated, and the shortest step wins.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import get_args

from stagewise.schedule.actions import Schedule
from stagewise.schedule.builders import BUILDERS, ScheduleName, build, v_shape
from stagewise.schedule.dependencies import ScheduleError
from stagewise.schedule.list_scheduling import Preference, list_schedule
from stagewise.schedule.simulate import StageCosts, simulate
from stagewise.schedule.validate import peak_in_flight, validate

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Synthesis:
    """The schedule :func:`synthesise` built, its simulated step, and the best built-in's for comparison."""

    schedule: Schedule
    step_time: float
    """Simulated seconds of one step of :attr:`schedule`."""
    builtin: str | None
    """The fastest built-in schedule of the same shape within the limits; None: none fits them."""
    builtin_step_time: float | None
    """Its simulated step."""
    tried: int
    """Candidates simulated."""


def _fits(schedule: Schedule, limit: Sequence[int]) -> bool:
    """Whether every stage holds no more micro-batches in flight than its rank's limit."""
    peak = peak_in_flight(schedule)
    return all(peak[s] <= limit[schedule.rank_of(s)] for s in range(schedule.n_stages))


def _builtins(n_ranks: int, n_stages: int, m: int) -> list[Schedule]:
    """Every built-in schedule that takes ``n_stages`` stages on ``n_ranks`` ranks and ``m`` micro-batches."""
    out = []
    for name in get_args(ScheduleName):
        try:
            out.append(build(name, n_stages, m, n_virtual=n_stages // n_ranks))
        except ValueError:
            continue
    return out


def synthesise(
    costs: StageCosts, n_ranks: int, n_microbatches: int, *, limit: int | Sequence[int] | None = None
) -> Synthesis:
    """The schedule with the shortest simulated step for ``costs`` (one entry per stage: ``n_ranks`` times the
    stages per rank) on ``n_ranks`` ranks and ``n_microbatches`` micro-batches, each rank holding at most
    ``limit`` (one number, or one per rank; None: no limit) micro-batches in flight on any of its stages.

    Raises:
        ValueError: stages that do not spread evenly over the ranks, or a limit below 1, with the values.
    """
    n_stages, m = len(costs.forward), n_microbatches
    if n_ranks < 1 or n_stages % n_ranks:
        raise ValueError(f"{n_stages} stages do not spread evenly over {n_ranks} ranks; give a multiple of {n_ranks}")
    if limit is None:
        limits = [m] * n_ranks
    elif isinstance(limit, int):
        limits = [limit] * n_ranks
    else:
        limits = list(limit)
    if len(limits) != n_ranks or any(x < 1 for x in limits):
        raise ValueError(f"limit must be one number >= 1 or one per rank ({n_ranks}), got {limit!r}")
    v = n_stages // n_ranks
    placements = [tuple(s % n_ranks for s in range(n_stages))] + ([v_shape(n_ranks)] if v == 2 else [])
    splits = (False, True) if any(w > 0 for w in costs.weight_grad) else (False,)
    preferences: tuple[Preference, ...] = ("later-stage", "earlier-microbatch")
    builtins = [s for s in _builtins(n_ranks, n_stages, m) if _fits(s, limits)]
    candidates = list(builtins)
    for placement, split, prefer in itertools.product(placements, splits, preferences):
        ranks = list_schedule(placement, m, split=split, limit=[min(x, m) for x in limits], costs=costs, prefer=prefer)
        name = f"synthesised ({'v' if placement != placements[0] else 'round robin'}, {'I/W' if split else 'B'})"
        candidates.append(Schedule(name, n_stages, m, tuple(tuple(r) for r in ranks), placement))
    timed = []
    for schedule in candidates:
        try:
            validate(schedule)
        except ScheduleError:
            continue
        if _fits(schedule, limits):
            timed.append((simulate(schedule, costs).step_time, schedule))
    step, best = min(timed, key=lambda pair: pair[0])
    fastest_builtin = min(((t, s) for t, s in timed if s.name in BUILDERS), key=lambda pair: pair[0], default=None)
    log.info("synthesised %s: %.4g s a step over %d candidates", best.name, step, len(timed))
    return Synthesis(
        schedule=best,
        step_time=step,
        builtin=fastest_builtin[1].name if fastest_builtin else None,
        builtin_step_time=fastest_builtin[0] if fastest_builtin else None,
        tried=len(timed),
    )
