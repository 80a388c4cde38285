"""search(): the ``top`` fastest of the candidate layouts, exactly, without evaluating those a bound rules out."""

from __future__ import annotations

import bisect
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass

from stagewise.errors import whole_number
from stagewise.plan.bounds import can_fit, pipeline_floor, step_floor
from stagewise.plan.cluster import Cluster
from stagewise.plan.evaluate import evaluate, measured, overheads, partitioned, rejected, timed
from stagewise.plan.option import Option
from stagewise.plan.rejection import Rejection
from stagewise.plan.setting import Setting, Settings
from stagewise.plan.workload import Workload
from stagewise.schedule import simulate

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Searched:
    """What a search found, each list in the candidates' order but :attr:`fastest`."""

    fastest: tuple[Option, ...]
    """The ``top`` fastest layouts that fit (fewer where fewer fit), fastest first, as evaluating every candidate
    ranks them: by step time, then peak memory, then the candidates' order."""
    rejected: tuple[Option, ...]
    """The candidates evaluated and rejected, with their reasons."""
    unranked: tuple[Option, ...]
    """The candidates left out of both: those a bound rules out (unevaluated) and those that fit but are slower
    than the ``top``-th."""


class _Ranking:
    """The ``top`` fastest layouts found so far, by (step time, peak memory, candidate number)."""

    def __init__(self, top: int) -> None:
        self.top = top
        self.keys: list[tuple[float, float, int]] = []

    def add(self, index: int, option: Option) -> None:
        bisect.insort(self.keys, (option.step_time, max(option.rank_memory), index))

    @property
    def bar(self) -> float:
        """The step time a layout must not exceed to be among the ``top`` fastest: the ``top``-th's, or inf."""
        return self.keys[self.top - 1][0] if len(self.keys) >= self.top else math.inf


def _exact(setting: Setting, workload: Workload, cluster: Cluster, bar: float) -> Option | Rejection | None:
    """``setting``'s option evaluated as :func:`~stagewise.plan.evaluate.evaluate` does; None where its partition's
    pipeline bound is already slower than ``bar`` (its schedule is not simulated)."""
    part = partitioned(setting)
    if isinstance(part, Rejection):
        return part
    costs = timed(setting, part, cluster)
    extra = overheads(setting, part, workload, cluster)
    if extra.step(pipeline_floor(setting, costs)) > bar:
        return None
    return measured(setting, part, simulate(setting.schedule, costs, cores=setting.cores), extra, workload, cluster)


def search(candidates: Sequence[Option], workload: Workload, cluster: Cluster, top: int) -> Searched:
    """The ``top`` fastest of ``candidates`` that fit, with the same figures as evaluating each of them.

    Every candidate's shape is checked; the others are taken in the order of a lower bound of their step time
    (:func:`~stagewise.plan.bounds.step_floor`). One whose bound is slower than the ``top``-th fastest found so far
    is not evaluated, nor is one whose stages can hold its layers under no split
    (:func:`~stagewise.plan.bounds.can_fit`), nor simulated one whose partition's bound is slower. Where none fits,
    every candidate is evaluated, so the rejections say what each would need.
    """
    whole_number("top", top, least=1, fix="give how many of the fastest layouts to find")
    settings = Settings(workload, cluster)
    refused: dict[int, Option] = {}
    bounded: list[tuple[float, int, Setting]] = []
    for index, option in enumerate(candidates):
        setting = settings.of(option)
        if isinstance(setting, Rejection):
            refused[index] = rejected(option, setting)
        else:
            bounded.append((step_floor(setting, workload, cluster), index, setting))
    bounded.sort(key=lambda item: (item[0], item[1]))
    ranking = _Ranking(top)
    fitting: dict[int, Option] = {}
    skipped: dict[int, Option] = {}
    for floor, index, setting in bounded:
        option = candidates[index]
        if floor > ranking.bar or not can_fit(setting):
            skipped[index] = option
            continue
        found = _exact(setting, workload, cluster, ranking.bar)
        if found is None:
            skipped[index] = option
        elif isinstance(found, Rejection):
            refused[index] = rejected(option, found)
        elif found.rejected is not None:  # its host memory overflows
            refused[index] = found
        else:
            fitting[index] = found
            ranking.add(index, found)
    if not fitting:  # nothing fits: what each layout would need (no bound of time ruled any out)
        for index, option in skipped.items():
            refused[index] = evaluate(option, workload, cluster)
            assert refused[index].rejected is not None, "can_fit() ruled out a layout that fits"
        skipped = {}
    ranked = [index for _, _, index in ranking.keys[:top]]
    slower = {index: option for index, option in fitting.items() if index not in ranked}
    unranked = skipped | slower
    log.info(
        "searched %d layouts for the %d fastest: %d evaluated, %d ruled out by bounds",
        len(candidates), top, len(fitting) + len(refused), len(skipped),
    )  # fmt: skip
    return Searched(
        fastest=tuple(fitting[index] for index in ranked),
        rejected=tuple(refused[index] for index in sorted(refused)),
        unranked=tuple(unranked[index] for index in sorted(unranked)),
    )
