"""Pairs of actions that run at once: a forward and the backward after it, of two stages of one rank, so that the
all-to-all of one (expert parallelism's token exchange) overlaps the compute of the other.

DualPipeV's steady state alternates F(a), B(b), F(b), B(a): each forward is followed by a whole backward of the
rank's other stage, of another micro-batch. Neither needs the other's result, so the backward runs in a thread of
its own while the forward runs here; their transfers stay on this thread, before and after. Each keeps its
collectives in order on a group of its own: the forward's all-to-alls on the ``ep`` group, the backward's on
:attr:`~stagewise.comm.mesh.ExpertGroups.backward`.

What overlaps depends on the device. On the CPU with gloo, a thread that waits in an all-to-all (for its peers to
reach it, and for the bytes) leaves the core to the other thread's compute; the compute itself shares the
process's cores. On a GPU, the two threads launch onto one stream unless given streams of their own, so only the
waits in the host code overlap, and NCCL's kernels overlap compute only as far as the device runs them beside it.

A pair is not formed where running at once would mix two actions' collectives on one group or share state
between them: a backward that synchronises replicas (DDP's all-reduce), stages gathered per micro-batch (FSDP),
tensor parallelism (both actions' collectives on the ``tp`` group), a backward that recomputes its forward
(activation checkpointing: its all-to-alls would run on the forward's group), or a split backward (I and W).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Collection, Sequence
from typing import Generic, TypeVar

from stagewise.schedule.actions import Action, Kind

T = TypeVar("T")


def overlapped_pairs(
    actions: Sequence[Action],
    *,
    exchanging: Collection[int],
    excluded: Collection[int],
    recomputing: Collection[int],
) -> set[int]:
    """The indices ``i`` whose action (a forward) runs at once with action ``i + 1`` (a whole backward of another
    stage): where either stage is in ``exchanging`` (it exchanges tokens by all-to-all), neither action's index is
    in ``excluded`` (a synchronising backward, say) and the backward's stage is not in ``recomputing``. Pairs do not
    overlap: an action is in one pair at most."""
    pairs: set[int] = set()
    i = 0
    while i + 1 < len(actions):
        f, b = actions[i], actions[i + 1]
        if (
            f.kind is Kind.F
            and b.kind is Kind.B
            and f.stage != b.stage
            and (f.stage in exchanging or b.stage in exchanging)
            and i not in excluded
            and i + 1 not in excluded
            and b.stage not in recomputing
        ):
            pairs.add(i)
            i += 2
        else:
            i += 1
    return pairs


class _Beside(threading.Thread, Generic[T]):
    """``work`` on a thread of its own; its result or its error kept for :meth:`result`."""

    def __init__(self, work: Callable[[], T]) -> None:
        super().__init__(name="stagewise-pair", daemon=True)
        self.work = work
        self.value: T | None = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.value = self.work()
        except BaseException as err:  # raised again on the caller's thread
            self.error = err

    def result(self) -> T:
        self.join()
        if self.error is not None:
            raise self.error
        return self.value  # type: ignore[return-value]


def run_together(here: Callable[[], T], beside: Callable[[], object]) -> tuple[T, object]:
    """``beside`` on a thread of its own while ``here`` runs on this one; both results. An error of either is
    raised here, after both have ended (``here``'s first)."""
    other = _Beside(beside)
    other.start()
    try:
        mine = here()
    except BaseException:
        other.join()
        raise
    return mine, other.result()
