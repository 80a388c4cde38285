"""validate(): every action once, dependencies in order, no deadlock, messages matched in order."""

from __future__ import annotations

import weakref
from collections import defaultdict
from dataclasses import dataclass

from stagewise.schedule.actions import Action, Kind, Schedule
from stagewise.schedule.dependencies import ScheduleError, backward_kinds, execute, inputs

_WHY = {
    (Kind.F, Kind.F): "a forward needs the previous stage's forward",
    (Kind.B, Kind.F): "a backward needs its own forward",
    (Kind.I, Kind.F): "a backward needs its own forward",
    (Kind.B, Kind.B): "a backward needs the next stage's backward",
    (Kind.B, Kind.I): "a backward needs the next stage's backward",
    (Kind.I, Kind.B): "a backward needs the next stage's backward",
    (Kind.I, Kind.I): "a backward needs the next stage's backward",
    (Kind.W, Kind.I): "W comes after its I",
}


@dataclass(frozen=True)
class ScheduleReport:
    """What a valid schedule implies."""

    peak_in_flight: tuple[int, ...]
    """Per stage: the most micro-batches forwarded whose backward (B or I) has not run yet."""
    messages: int
    """Point-to-point messages between ranks in one step."""


def _where(schedule: Schedule) -> dict[Action, list[tuple[int, int]]]:
    found: dict[Action, list[tuple[int, int]]] = defaultdict(list)
    for rank, actions in enumerate(schedule.ranks):
        for i, action in enumerate(actions):
            found[action].append((rank, i))
    return found


def _check_each_once(schedule: Schedule, where: dict[Action, list[tuple[int, int]]]) -> None:
    def at(action: Action) -> str:
        return ", ".join(f"rank {r} action {i}" for r, i in where.get(action, []))

    used = {action.stage for action in where}
    for stage in range(schedule.n_stages):
        if stage not in used:
            p = schedule.n_ranks
            fix = f"give stage {stage} its forwards and backwards on rank {schedule.rank_of(stage)}"
            if stage > max(used, default=-1):  # the count was rounded up to a multiple of the ranks
                fix += f", or use stages 0 .. {stage - 1} on a number of ranks that divides {stage}"
            raise ScheduleError(
                f"stage {stage} has no actions at all; a schedule on {p} ranks has a multiple of {p} stages "
                f"(each rank holds as many), here {schedule.n_stages}: {fix}"
            )
        for mb in range(schedule.n_microbatches):
            label = f"stage {stage}, micro-batch {mb}"
            count = {kind: len(where.get(Action(stage, kind, mb), [])) for kind in Kind}
            for kind in Kind:
                if count[kind] > 1:
                    repeated = Action(stage, kind, mb)
                    raise ScheduleError(f"{label} has {count[kind]} {kind.value} actions ({at(repeated)})")
            if count[Kind.F] == 0:
                raise ScheduleError(f"{label} has no forward: add {Action(stage, Kind.F, mb)}")
            if count[Kind.B] and count[Kind.I]:
                raise ScheduleError(f"{label} has both a full backward B and a split one I; keep one")
            if count[Kind.B] and count[Kind.W]:
                raise ScheduleError(f"{label} has a W after a full backward B, which already computed it")
            if count[Kind.I] and not count[Kind.W]:
                raise ScheduleError(
                    f"{label} has {Action(stage, Kind.I, mb)} but no W: its weight gradient is never computed"
                )
            if count[Kind.W] and not count[Kind.I]:
                raise ScheduleError(f"{Action(stage, Kind.W, mb)} ({at(Action(stage, Kind.W, mb))}) has no I to follow")
            if not count[Kind.B] and not count[Kind.I]:
                raise ScheduleError(f"{label} has no backward (B, or I then W)")


def _check_rank_order(schedule: Schedule, where: dict[Action, list[tuple[int, int]]]) -> None:
    backward = backward_kinds(schedule)
    for rank, actions in enumerate(schedule.ranks):
        for i, action in enumerate(actions):
            for need in inputs(action, schedule.n_stages, backward):
                r, j = where[need][0]
                if r == rank and j > i:
                    raise ScheduleError(
                        f"rank {rank}, action {i} ({action}) runs before {need} (action {j}), which it needs: "
                        f"{_WHY[(action.kind, need.kind)]}"
                    )


def _check_message_order(schedule: Schedule) -> int:
    """Each stream between two ranks (activations, gradients) must be received in the order it is sent.

    The transport keeps the streams apart (by tag on gloo, by a process group
    each on NCCL, which matches messages in the order both ranks post them),
    so only the order within a stream matters.
    """
    sent: dict[tuple[int, int, str], list[str]] = defaultdict(list)
    received: dict[tuple[int, int, str], list[str]] = defaultdict(list)
    last = schedule.n_stages - 1
    for rank, actions in enumerate(schedule.ranks):
        for a in actions:
            s, mb = a.stage, a.microbatch
            if a.kind is Kind.F:
                if s > 0 and schedule.rank_of(s - 1) != rank:
                    received[(schedule.rank_of(s - 1), rank, "activations")].append(
                        f"activation {s - 1}->{s} of micro-batch {mb}"
                    )
                if s < last and schedule.rank_of(s + 1) != rank:
                    sent[(rank, schedule.rank_of(s + 1), "activations")].append(
                        f"activation {s}->{s + 1} of micro-batch {mb}"
                    )
            elif a.kind.is_backward:
                if s < last and schedule.rank_of(s + 1) != rank:
                    received[(schedule.rank_of(s + 1), rank, "gradients")].append(
                        f"gradient {s + 1}->{s} of micro-batch {mb}"
                    )
                if s > 0 and schedule.rank_of(s - 1) != rank:
                    sent[(rank, schedule.rank_of(s - 1), "gradients")].append(
                        f"gradient {s}->{s - 1} of micro-batch {mb}"
                    )
    for (src, dst, stream), order in sent.items():
        got = received.get((src, dst, stream), [])
        for n, (out, into) in enumerate(zip(order, got, strict=False)):
            if out != into:
                raise ScheduleError(
                    f"rank {dst} receives the {stream} from rank {src} out of order: message {n} sent is the {out}, "
                    f"but rank {dst} expects the {into}; each stream between two ranks arrives in the order sent"
                )
    return sum(len(order) for order in sent.values())


def validate(schedule: Schedule) -> ScheduleReport:
    """Check that ``schedule`` can run, and report its peak micro-batches in flight per stage.

    Checks, in order, each failure a :class:`ScheduleError` naming the rank,
    the action and the broken rule:

    1. every (stage, micro-batch) has exactly one F and one backward: B, or I then W;
    2. on each rank, an action comes after the actions of that rank it needs
       (F after the previous stage's F, B or I after its own F and the next
       stage's backward, W after its I);
    3. the ranks, each running its actions in order and waiting for the inputs
       it receives (sends do not wait), never wait on each other in a cycle;
    4. messages between two ranks are received in the order they are sent.
    """
    known = _REPORTS.get(id(schedule))
    if known is not None:  # a Schedule never changes: validated once (the planner simulates one per layout)
        return known
    where = _where(schedule)
    _check_each_once(schedule, where)
    _check_rank_order(schedule, where)
    execute(schedule, lambda _: 1.0, lambda _a, _b: 0.0)
    messages = _check_message_order(schedule)
    report = ScheduleReport(peak_in_flight=peak_in_flight(schedule), messages=messages)
    _REPORTS[id(schedule)] = report
    weakref.finalize(schedule, _REPORTS.pop, id(schedule), None)
    return report


_REPORTS: dict[int, ScheduleReport] = {}
"""The report of each live Schedule validated, by identity; an entry goes with its schedule."""


def peak_in_flight(schedule: Schedule) -> tuple[int, ...]:
    """Per stage: the most micro-batches forwarded whose saved activations are still held, until their backward
    (B) has run, or with a split backward their weight pass (W): the input pass (I) keeps the graph for it."""
    split = {(a.stage, a.microbatch) for actions in schedule.ranks for a in actions if a.kind is Kind.W}
    current = [0] * schedule.n_stages
    peak = [0] * schedule.n_stages
    for actions in schedule.ranks:
        for a in actions:
            if a.kind is Kind.F:
                current[a.stage] += 1
                peak[a.stage] = max(peak[a.stage], current[a.stage])
            elif a.kind is Kind.W or (a.kind.is_backward and (a.stage, a.microbatch) not in split):
                current[a.stage] -= 1
    return tuple(peak)
