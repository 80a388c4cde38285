"""Run a schedule's actions in dependency order: the one definition of what each action waits for."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from stagewise.errors import StagewiseError
from stagewise.schedule.actions import Action, Kind, Schedule


class ScheduleError(StagewiseError, ValueError):
    """A schedule that cannot run: a missing or repeated action, a broken dependency, or a deadlock."""


@dataclass(frozen=True)
class Event:
    """One action as it ran (or would run): on ``rank`` from ``start`` to ``end``."""

    rank: int
    action: Action
    start: float
    end: float


def backward_kinds(schedule: Schedule) -> dict[tuple[int, int], Kind]:
    """For each (stage, micro-batch), the kind of its gradient-passing backward: B, or I when split."""
    kinds: dict[tuple[int, int], Kind] = {}
    for actions in schedule.ranks:
        for a in actions:
            if a.kind.is_backward:
                kinds[(a.stage, a.microbatch)] = a.kind
    return kinds


def inputs(action: Action, n_stages: int, backward: dict[tuple[int, int], Kind]) -> list[Action]:
    """The actions whose results ``action`` needs before it can start.

    F on stage s needs F on s - 1 (the activation). B or I on s needs its own
    F (the saved activations) and the backward of s + 1 (the output gradient).
    W needs its I.
    """
    s, mb = action.stage, action.microbatch
    if action.kind is Kind.F:
        return [Action(s - 1, Kind.F, mb)] if s > 0 else []
    if action.kind is Kind.W:
        return [Action(s, Kind.I, mb)]
    needs = [Action(s, Kind.F, mb)]
    if s + 1 < n_stages:
        needs.append(Action(s + 1, backward.get((s + 1, mb), Kind.B), mb))
    return needs


def execute(
    schedule: Schedule,
    duration: Callable[[Action], float],
    transfer: Callable[[int, int], float],
) -> list[Event]:
    """Run every rank's actions in order, each as soon as its rank is free and its inputs have arrived.

    Sends never block; an action waits only for the inputs it needs. An
    input made on another rank arrives ``transfer(from_stage, to_stage)``
    after it ends. Raises :class:`ScheduleError` when ranks wait on each other
    in a cycle, naming each waiting rank, its action and what it waits for.
    The schedule must hold each action it refers to (see ``validate``).
    """
    backward = backward_kinds(schedule)
    n_stages = schedule.n_stages
    ended: dict[Action, float] = {}
    position = [0] * schedule.n_ranks
    free = [0.0] * schedule.n_ranks
    events: list[Event] = []
    remaining = sum(len(actions) for actions in schedule.ranks)
    while remaining:
        progressed = False
        for rank, actions in enumerate(schedule.ranks):
            while position[rank] < len(actions):
                action = actions[position[rank]]
                needs = inputs(action, n_stages, backward)
                if any(need not in ended for need in needs):
                    break
                start = free[rank]
                for need in needs:
                    ready = ended[need]
                    if schedule.rank_of(need.stage) != rank:
                        ready += transfer(need.stage, action.stage)
                    start = max(start, ready)
                end = start + duration(action)
                ended[action] = end
                free[rank] = end
                events.append(Event(rank, action, start, end))
                position[rank] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise ScheduleError(deadlock_message(schedule, position, ended, backward))
    return events


def deadlock_message(
    schedule: Schedule, position: list[int], ended: dict[Action, float], backward: dict[tuple[int, int], Kind]
) -> str:
    """Why no rank can go on: each waiting rank, its next action (``position``) and the inputs it waits for."""
    waits = []
    for rank, actions in enumerate(schedule.ranks):
        if position[rank] >= len(actions):
            continue
        action = actions[position[rank]]
        missing = [n for n in inputs(action, schedule.n_stages, backward) if n not in ended]
        on = ", ".join(f"{n} (rank {schedule.rank_of(n.stage)})" for n in missing)
        waits.append(f"rank {rank} waits in action {position[rank]} ({action}) for {on}")
    return "deadlock: the ranks wait on each other in a cycle: " + "; ".join(waits)
