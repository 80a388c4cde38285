"""List scheduling: each rank's actions ordered by simulating the step, over any placement of the stages.

At every moment the action that can start earliest runs next on its rank; among those that start together, a
backward (B or I, on the critical path) goes before a forward, and a forward before a weight pass (W, which only
fills time that would be idle), and the later stage before the earlier (it is nearer the end of its micro-batch).
A micro-batch enters a rank with the forward of the rank's first stage, and leaves it when that stage's B (or W)
releases its activations; that forward waits while ``limit`` micro-batches are in the
rank, which bounds the rank's activation memory (its later stages' forwards never wait: they are how a micro-batch
already in the rank moves on). With measured costs (:class:`StageCosts`), transfers included, it builds
schedules for them (:func:`stagewise.schedule.synthesise`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from stagewise.schedule.actions import Action, Kind
from stagewise.schedule.simulate import StageCosts

_PRIORITY = {Kind.B: 0, Kind.I: 0, Kind.F: 1, Kind.W: 2}
"""Among actions that can start at the same moment: backwards first, then forwards, then weight passes."""


Preference = Literal["later-stage", "earlier-microbatch"]
"""Which of two actions of the same priority that can start together runs first: the later stage's (nearer the
end of its micro-batch), or the earlier micro-batch's."""


@dataclass
class _State:
    """What has run so far: when each action ended, and each rank's free time and micro-batches in flight."""

    ends: dict[Action, float]
    free: list[float]
    in_flight: list[int]


def list_schedule(
    placement: Sequence[int],
    n_microbatches: int,
    *,
    split: bool,
    limit: Sequence[int],
    costs: StageCosts,
    prefer: Preference = "later-stage",
) -> list[list[Action]]:
    """Each rank's actions, in order, for stages held as ``placement`` says (``placement[s]``: the rank of stage
    ``s``), ``n_microbatches`` micro-batches, a backward split into I and W (``split``) or whole (B), at most
    ``limit[r]`` micro-batches in flight on rank ``r`` (each at least 1), timed by ``costs``, ties broken as
    ``prefer`` says."""
    n_ranks, m = len(limit), n_microbatches
    first = [placement.index(r) for r in range(n_ranks)]
    kinds = (Kind.F, Kind.I, Kind.W) if split else (Kind.F, Kind.B)
    mine = [[s for s, holder in enumerate(placement) if holder == r] for r in range(n_ranks)]
    done = {(s, kind): 0 for s in range(len(placement)) for kind in kinds}  # each kind runs in micro-batch order
    state = _State({}, [0.0] * n_ranks, [0] * n_ranks)
    order: list[list[Action]] = [[] for _ in range(n_ranks)]

    def best_of(r: int) -> tuple[float, int, int, int, Action] | None:
        """Rank ``r``'s next action as things stand, keyed by when it starts, its priority and the tie-break."""
        best: tuple[float, int, int, int, Action] | None = None
        for s in mine[r]:
            for kind in kinds:
                if done[(s, kind)] == m:
                    continue
                action = Action(s, kind, done[(s, kind)])
                start = _ready(action, placement, state, costs, limit[r] if s == first[r] else None)
                if start is None:
                    continue
                tie = -s if prefer == "later-stage" else action.microbatch
                key = (max(start, state.free[r]), _PRIORITY[kind], tie, r, action)
                if best is None or key[:4] < best[:4]:
                    best = key
        return best

    ranked = [best_of(r) for r in range(n_ranks)]
    for _ in range(len(placement) * len(kinds) * m):
        chosen = min((key for key in ranked if key is not None), key=lambda key: key[:4], default=None)
        if chosen is None:
            raise ValueError(f"no action can run next under the limit {list(limit)}: give each rank room for 1 or more")
        start, _, _, r, action = chosen
        state.ends[action] = start + costs.duration(action)
        state.free[r] = state.ends[action]
        if action.stage == first[r] and action.kind is Kind.F:
            state.in_flight[r] += 1
        elif action.stage == first[r] and action.kind in (Kind.B, Kind.W):
            state.in_flight[r] -= 1
        done[(action.stage, action.kind)] += 1
        order[r].append(action)
        # Only this rank and the ranks of the neighbouring stages can have a new next action.
        neighbours = {placement[x] for x in (action.stage - 1, action.stage + 1) if 0 <= x < len(placement)}
        for q in {r} | neighbours:
            ranked[q] = best_of(q)
    return order


def _ready(
    action: Action, placement: Sequence[int], state: _State, costs: StageCosts, limit: int | None
) -> float | None:
    """When ``action`` could start as far as its inputs and its rank's memory go (``limit``: micro-batches the
    rank may hold, for a forward that brings one in); None: not yet."""
    s, mb, ends = action.stage, action.microbatch, state.ends

    def arrival(needed: Action) -> float | None:
        end = ends.get(needed)
        if end is None:
            return None
        return end + (costs.crossing(needed.stage, s) if placement[needed.stage] != placement[s] else 0.0)

    if action.kind is Kind.F:
        if limit is not None and state.in_flight[placement[s]] >= limit:
            return None
        return 0.0 if s == 0 else arrival(Action(s - 1, Kind.F, mb))
    if action.kind is Kind.W:
        return ends.get(Action(s, Kind.I, mb))
    own = ends.get(Action(s, Kind.F, mb))
    if own is None:
        return None
    if s == len(placement) - 1:
        return own
    later = arrival(Action(s + 1, action.kind, mb))
    return None if later is None else max(own, later)
