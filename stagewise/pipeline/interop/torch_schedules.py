"""Schedules both ways with torch.distributed.pipelining: exported to torch's actions, its schedule classes imported.

Both write an action as stage, kind, micro-batch (``0F3``), so the conversion is one to one: F, B, I and W map to
torch's FORWARD, FULL_BACKWARD, BACKWARD_INPUT and BACKWARD_WEIGHT. torch's runtime adds its own sends and
receives to compute-only actions (``_PipelineScheduleRuntime._load_actions``), so :func:`to_torch` exports those.
Importing reads the ``pipeline_order`` a torch schedule class computes in its constructor for every rank. The class
is given stand-ins for its stages, which carry only their index, count and rank, since it builds the order from
those alone. Idle slots (``None``) are dropped. DualPipeV's overlapped forward-and-backward becomes its forward then
its backward, as its sub-actions list them.

torch's names relied on: the public schedule classes and ``pipeline_order``, ``stage_index_to_group_rank``; the
private ``_Action`` and ``_ComputationType`` (torch has no public name for an action), as
``torch.distributed.pipelining`` documents its custom-schedule format with them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from stagewise.schedule import Action, Kind, Schedule

if TYPE_CHECKING:  # importing torch.distributed.pipelining takes a second and a half (dynamo, DTensor)
    from torch.distributed.pipelining.schedules import _Action

_KINDS = {Kind.F: "FORWARD", Kind.B: "FULL_BACKWARD", Kind.I: "BACKWARD_INPUT", Kind.W: "BACKWARD_WEIGHT"}
"""Each stagewise kind's name among torch's ``_ComputationType`` members."""


def to_torch(schedule: Schedule) -> dict[int, list[_Action | None]]:
    """``schedule`` as torch's compute-only actions per rank: what ``_PipelineScheduleRuntime._load_actions``
    takes (with ``format="compute_only"``), and torch's simulator and validator read."""
    from torch.distributed.pipelining.schedules import _Action, _ComputationType

    return {
        rank: [_Action(a.stage, _ComputationType[_KINDS[a.kind]], a.microbatch) for a in actions]
        for rank, actions in enumerate(schedule.ranks)
    }


def from_actions(actions: dict[int, list[_Action | None]], n_microbatches: int, *, name: str) -> Schedule:
    """A stagewise :class:`Schedule` from torch's compute actions per rank (idle slots and communication dropped,
    overlapped forward-and-backward split into its sub-actions in order); each stage on the rank that runs it."""
    from torch.distributed.pipelining.schedules import _ComputationType

    kinds = {_ComputationType[torch_name]: kind for kind, torch_name in _KINDS.items()}
    ranks: list[tuple[Action, ...]] = []
    for rank in range(len(actions)):
        mine: list[Action] = []
        for action in actions[rank]:
            for part in _compute_parts(action):
                if part.computation_type not in kinds:
                    continue  # sends, receives, unshard, reshard, gradient reduction: the executor's own business
                if part.microbatch_index is None:
                    raise ValueError(f"torch's action {part} on rank {rank} has no micro-batch")
                mine.append(Action(part.stage_index, kinds[part.computation_type], part.microbatch_index))
        ranks.append(tuple(mine))
    text = "\n".join(f"rank {r}: " + " ".join(str(a) for a in mine) for r, mine in enumerate(ranks))
    schedule = Schedule.from_text(text, name=name)
    if schedule.n_microbatches != n_microbatches:
        raise ValueError(f"{name} runs {schedule.n_microbatches} micro-batches, not the {n_microbatches} asked for")
    return schedule


def _compute_parts(action: _Action | None) -> list[_Action]:
    if action is None:
        return []
    if action.sub_actions is not None:
        return [part for sub in action.sub_actions for part in _compute_parts(sub)]
    return [action]


@dataclass
class _StandIn:
    """What a torch schedule class reads of a stage to build its order: nothing else is ever called."""

    stage_index: int
    num_stages: int
    group_size: int
    group_rank: int
    submod: None = None
    stage_index_to_group_rank: Any = None

    @property
    def is_first(self) -> bool:
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        return self.stage_index == self.num_stages - 1


def from_torch(schedule_class: type[Any], n_ranks: int, n_microbatches: int, *, n_stages: int) -> Schedule:
    """torch's ``schedule_class`` (e.g. ``ScheduleZBVZeroBubble``, ``ScheduleDualPipeV``,
    ``ScheduleInterleaved1F1B``) for ``n_stages`` stages on ``n_ranks`` ranks and ``n_microbatches``
    micro-batches, as a stagewise :class:`Schedule` that ``Pipeline`` runs, ``validate`` checks and ``simulate``
    times. Its constructor's own refusals (e.g. DualPipeV's ``n_microbatches >= n_stages``) come through as they
    are."""
    from torch.distributed.pipelining.schedules import PipelineScheduleMulti

    if not (isinstance(schedule_class, type) and issubclass(schedule_class, PipelineScheduleMulti)):
        raise TypeError(
            f"from_torch takes one of torch's multi-stage schedule classes (PipelineScheduleMulti: Interleaved1F1B, "
            f"LoopedBFS, InterleavedZeroBubble, ZBVZeroBubble, DualPipeV), got {schedule_class!r}; "
            "for GPipe and 1F1B use stagewise's own"
        )
    if n_stages % n_ranks:
        raise ValueError(f"{n_stages} stages do not spread evenly over {n_ranks} ranks; give a multiple of {n_ranks}")

    def stand_ins(stages: list[int]) -> list[Any]:  # typed as torch's stages, which they stand in for
        return [_StandIn(s, n_stages, n_ranks, 0) for s in stages]

    probe = schedule_class(stand_ins(list(range(n_stages // n_ranks))), n_microbatches)
    placement = probe.stage_index_to_group_rank  # where the class puts each stage (V or loop)
    built = schedule_class(stand_ins([s for s in range(n_stages) if placement[s] == 0]), n_microbatches)
    return from_actions(built.pipeline_order, n_microbatches, name=f"torch:{schedule_class.__name__}")
