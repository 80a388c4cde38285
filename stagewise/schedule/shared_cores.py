"""Ranks that take turns on fewer CPU cores than they are: each computes faster while others wait.

A job of more processes than its machine has cores runs them in turns: while every rank computes, each gets
``cores / processes`` of a core; while some wait for a transfer or sit in a pipeline's bubble, the others get the
cores they leave, up to one each. Costs measured with every rank busy (the planner profiles under that load) are
then slower than what a rank alone in the bubble takes, and a schedule simulated at their fixed durations is slower
than the run. :func:`execute_shared` runs a schedule with each action's speed set by how many ranks compute at once.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from stagewise.errors import whole_number
from stagewise.schedule.actions import Action, Schedule
from stagewise.schedule.dependencies import Event, ScheduleError, backward_kinds, deadlock_message, inputs

_DONE = 1e-12
"""Seconds of work left under which an action counts as finished (what floating point leaves of it)."""


@dataclass(frozen=True)
class SharedCores:
    """How a pipeline's ranks share one machine's CPU cores."""

    cores: int
    """CPU cores the job's processes compute on (one intra-op thread each)."""
    processes_per_rank: int = 1
    """Processes that run each pipeline rank's actions at the same moments: its data-parallel, FSDP and
    tensor-parallel ranks."""
    profiled: int = 1
    """Processes that computed at once while the costs were measured (each then ran at ``min(1, cores /
    profiled)`` of a core)."""

    def __post_init__(self) -> None:
        for name in ("cores", "processes_per_rank", "profiled"):
            whole_number(name, getattr(self, name), least=1, fix="give a count of CPU cores or processes")

    def speed(self, busy: int) -> float:
        """How fast each of ``busy`` pipeline ranks computing at once runs, against the costs' speed: each of
        their processes gets ``min(1, cores / processes)`` of a core."""
        running = max(busy, 1) * self.processes_per_rank
        return min(1.0, self.cores / running) / min(1.0, self.cores / self.profiled)

    @property
    def fastest(self) -> float:
        """The most :meth:`speed` gives: one pipeline rank computing alone."""
        return self.speed(1)


@dataclass
class _Running:
    """An action in progress: its rank, when it started and the seconds of work (at the costs' speed) left."""

    rank: int
    action: Action
    start: float
    left: float


def execute_shared(
    schedule: Schedule,
    duration: Callable[[Action], float],
    transfer: Callable[[int, int], float],
    cores: SharedCores,
) -> list[Event]:
    """Run every rank's actions in order as :func:`~stagewise.schedule.dependencies.execute` does, each action's
    ``duration`` (seconds at the costs' speed) worked off at :meth:`SharedCores.speed` of the ranks computing at
    each moment. Transfers take their seconds whatever the load. Raises
    :class:`~stagewise.schedule.dependencies.ScheduleError` on a deadlock."""
    backward = backward_kinds(schedule)
    n_stages = schedule.n_stages
    ended: dict[Action, float] = {}
    position = [0] * schedule.n_ranks
    running: dict[int, _Running] = {}
    events: list[Event] = []
    now = 0.0
    while any(position[r] < len(actions) for r, actions in enumerate(schedule.ranks)):
        waking = math.inf
        for rank, actions in enumerate(schedule.ranks):
            if rank in running or position[rank] >= len(actions):
                continue
            action = actions[position[rank]]
            ready = _ready(schedule, action, inputs(action, n_stages, backward), ended, transfer)
            if ready is None:
                continue
            if ready <= now:
                running[rank] = _Running(rank, action, now, duration(action))
            else:
                waking = min(waking, ready)
        if not running:
            if waking == math.inf:
                raise ScheduleError(deadlock_message(schedule, position, ended, backward))
            now = waking
            continue
        speed = cores.speed(len(running))
        step = min(min(r.left for r in running.values()) / speed, waking - now)
        now += step
        for rank in list(running):
            work = running[rank]
            work.left -= step * speed
            if work.left <= _DONE:
                ended[work.action] = now
                events.append(Event(rank, work.action, work.start, now))
                position[rank] += 1
                del running[rank]
    return events


def _ready(
    schedule: Schedule,
    action: Action,
    needs: list[Action],
    ended: dict[Action, float],
    transfer: Callable[[int, int], float],
) -> float | None:
    """When ``action``'s inputs are all at hand (an input made on another rank a transfer after it ended); None
    while one is still to be made."""
    if any(need not in ended for need in needs):
        return None
    ready = 0.0
    for need in needs:
        at = ended[need]
        if schedule.rank_of(need.stage) != schedule.rank_of(action.stage):
            at += transfer(need.stage, action.stage)
        ready = max(ready, at)
    return ready
