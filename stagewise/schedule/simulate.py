"""simulate(): step time, bubble, busy and idle time, and activation memory of a schedule, from stage costs."""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

from stagewise.schedule.actions import Action, Kind, Schedule
from stagewise.schedule.dependencies import Event, execute
from stagewise.schedule.shared_cores import SharedCores, execute_shared
from stagewise.schedule.validate import validate


def _per_stage(field: str, values: float | Sequence[float], n: int, *, per: str = "stage") -> tuple[float, ...]:
    """``values`` as ``n`` numbers >= 0, one ``per`` stage (or boundary between stages); one number for all."""
    if isinstance(values, numbers.Real):  # int, float and numpy's scalars
        out = (float(values),) * n
    else:
        out = tuple(float(v) for v in cast("Sequence[float]", values))
    if len(out) != n:
        things = "stages" if per == "stage" else "boundaries between stages (one fewer than the stages)"
        raise ValueError(f"{field} has {len(out)} entries for {n} {things}; give one per {per} (or one number)")
    if any(not v >= 0 for v in out):  # also refuses NaN
        raise ValueError(f"{field} must be >= 0 for every {per}, got {list(out)}")
    return out


def _rest(part: str, given: tuple[float, ...], backward: tuple[float, ...]) -> tuple[float, ...]:
    """The other part of each stage's backward once ``part`` of it is ``given``: refused where it would be < 0."""
    over = [s for s, (x, b) in enumerate(zip(given, backward, strict=True)) if x > b]
    if over:
        s = over[0]
        raise ValueError(
            f"{part} takes {given[s]:g} on stage {s}, more than the whole backward ({backward[s]:g}): I and W split "
            "B, so neither exceeds it; give a larger backward, or both input_grad and weight_grad"
        )
    return tuple(b - x for x, b in zip(given, backward, strict=True))


def _check_split(i: tuple[float, ...], w: tuple[float, ...], b: tuple[float, ...]) -> None:
    """Refuse an input_grad and weight_grad that add up to less than the backward they split (more is what a split
    measured costs when its two passes each walk the graph)."""
    for s, (x, y, whole) in enumerate(zip(i, w, b, strict=True)):
        if x + y < whole and not math.isclose(x + y, whole, rel_tol=1e-9, abs_tol=1e-12):
            raise ValueError(
                f"input_grad ({x:g}) + weight_grad ({y:g}) = {x + y:g} on stage {s}, less than backward ({whole:g}): "
                "I and W split B, so together they take at least as long; give two of the three, or all three as "
                "measured"
            )


@dataclass(frozen=True)
class StageCosts:
    """Per-stage time of each action kind for one micro-batch, and the transfer time between stages."""

    forward: tuple[float, ...]
    """Seconds of F, per stage."""
    backward: tuple[float, ...]
    """Seconds of a full backward B, per stage."""
    input_grad: tuple[float, ...]
    """Seconds of I (input-gradient backward), per stage."""
    weight_grad: tuple[float, ...]
    """Seconds of W (weight-gradient backward), per stage."""
    transfer: tuple[float, ...]
    """Seconds to send a boundary's activation or gradient between ranks; entry s is between s and s + 1."""
    activation_bytes: tuple[float, ...] | None = None
    """Bytes a stage keeps per micro-batch from its F to its B or I, when known."""

    @classmethod
    def of(
        cls,
        n_stages: int,
        *,
        forward: float | Sequence[float] = 1.0,
        backward: float | Sequence[float] | None = None,
        input_grad: float | Sequence[float] | None = None,
        weight_grad: float | Sequence[float] | None = None,
        transfer: float | Sequence[float] = 0.0,
        activation_bytes: float | Sequence[float] | None = None,
    ) -> StageCosts:
        """Costs from numbers (the same for every stage) or per-stage sequences.

        ``backward`` defaults to ``input_grad + weight_grad`` when both are
        given, else to twice ``forward``. ``input_grad`` defaults to half of
        ``backward`` and ``weight_grad`` to the rest. Given all three (as
        measured), ``input_grad + weight_grad`` may exceed ``backward``, by
        what splitting costs, but not fall below it.
        """
        if n_stages < 1:
            raise ValueError(f"n_stages must be >= 1, got {n_stages}")
        f = _per_stage("forward", forward, n_stages)
        i = None if input_grad is None else _per_stage("input_grad", input_grad, n_stages)
        w = None if weight_grad is None else _per_stage("weight_grad", weight_grad, n_stages)
        if backward is not None:
            b = _per_stage("backward", backward, n_stages)
            if i is not None and w is not None:
                _check_split(i, w, b)
        elif i is not None and w is not None:
            b = tuple(x + y for x, y in zip(i, w, strict=True))
        else:
            b = tuple(2.0 * x for x in f)
        if i is None:
            i = tuple(x / 2 for x in b) if w is None else _rest("weight_grad", w, b)
        if w is None:
            w = _rest("input_grad", i, b)
        return cls(
            forward=f,
            backward=b,
            input_grad=i,
            weight_grad=w,
            transfer=_per_stage("transfer", transfer, max(n_stages - 1, 1), per="boundary"),
            activation_bytes=None
            if activation_bytes is None
            else _per_stage("activation_bytes", activation_bytes, n_stages),
        )

    def duration(self, action: Action) -> float:
        """Seconds that ``action`` takes."""
        table = {
            Kind.F: self.forward,
            Kind.B: self.backward,
            Kind.I: self.input_grad,
            Kind.W: self.weight_grad,
        }[action.kind]
        return table[action.stage]

    def crossing(self, from_stage: int, to_stage: int) -> float:
        """Seconds for a message between adjacent stages ``from_stage`` and ``to_stage``."""
        return self.transfer[min(from_stage, to_stage)]


@dataclass(frozen=True)
class SimulationResult:
    """What one training step of a schedule costs."""

    step_time: float
    """Seconds from the first action's start to the last action's end."""
    busy: tuple[float, ...]
    """Per rank: seconds computing."""
    idle: tuple[float, ...]
    """Per rank: seconds waiting within the step."""
    bubble: float
    """Fraction of rank-time idle: ``1 - sum(busy) / (n_ranks * step_time)``."""
    peak_in_flight: tuple[int, ...]
    """Per stage: the most micro-batches forwarded but not yet through backward (B or I)."""
    peak_activation_bytes: tuple[float, ...] | None
    """Per stage: ``peak_in_flight * activation_bytes``, when the costs give activation bytes."""
    timeline: tuple[Event, ...]
    """Every action with its rank, start and end, in the order they were placed."""


def simulate(schedule: Schedule, costs: StageCosts, *, cores: SharedCores | None = None) -> SimulationResult:
    """Run ``schedule`` against ``costs`` in simulated time.

    Each rank runs its actions in order; an action starts when its rank is
    free and its inputs have arrived (an input from another rank arrives the
    boundary's transfer time after it was made). The schedule is validated first.
    With ``cores``, the ranks are processes taking turns on fewer CPU cores than
    they are: each action runs at the speed that the ranks computing beside it
    leave it (:class:`~stagewise.schedule.shared_cores.SharedCores`).
    """
    if len(costs.forward) != schedule.n_stages:
        raise ValueError(
            f"costs are for {len(costs.forward)} stages but the schedule has {schedule.n_stages}; "
            "build StageCosts with the schedule's stage count"
        )
    report = validate(schedule)
    events = (
        execute(schedule, costs.duration, costs.crossing)
        if cores is None
        else execute_shared(schedule, costs.duration, costs.crossing, cores)
    )
    start = min(e.start for e in events)
    step = max(e.end for e in events) - start
    busy = [0.0] * schedule.n_ranks
    for e in events:
        busy[e.rank] += e.end - e.start
    idle = tuple(step - b for b in busy)
    bubble = 1.0 - sum(busy) / (schedule.n_ranks * step) if step > 0 else 0.0
    peak_bytes = (
        None
        if costs.activation_bytes is None
        else tuple(q * b for q, b in zip(report.peak_in_flight, costs.activation_bytes, strict=True))
    )
    return SimulationResult(
        step_time=step,
        busy=tuple(busy),
        idle=idle,
        bubble=bubble,
        peak_in_flight=report.peak_in_flight,
        peak_activation_bytes=peak_bytes,
        timeline=tuple(events),
    )
