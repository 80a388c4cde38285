"""Lower bounds of a layout's step time, and whether any split of its layers can fit: what lets a search skip it.

Each bound holds for every partition and is a little under the exact figure (by :data:`SLACK`), so a layout whose
bound is slower than the ``top``-th fastest found cannot be among the ``top`` fastest; one whose stages can hold the
layers under no split is one that :func:`~stagewise.plan.evaluate.evaluate` rejects.
"""

from __future__ import annotations

import numpy as np

from stagewise.plan.cluster import Cluster
from stagewise.plan.evaluate import Overheads
from stagewise.plan.setting import ScheduleShape, Setting, cached_shape
from stagewise.plan.time_model import optimizer_seconds, sync_seconds
from stagewise.plan.workload import Workload
from stagewise.schedule import StageCosts

SLACK = 1e-9
"""How far under its exact figure a time bound is set, so that sums taken in another order never lift it over."""
MEMORY_SLACK = 1e-6
"""How far over a stage's capacity the fit test lets a range's bound go, for the same reason."""


def _shape_of(setting: Setting) -> ScheduleShape:
    o = setting.option
    return cached_shape(o.schedule, setting.schedule.n_stages, o.n_microbatches, o.n_virtual)


def step_floor(setting: Setting, workload: Workload, cluster: Cluster) -> float:
    """Seconds that ``setting``'s step takes at least, whatever its partition.

    A rank runs its actions one at a time, so the busiest runs at least ``m`` times its share of every layer's
    forward and backward, and at least ``m`` times the longest layer's. Stage ``s`` starts after one micro-batch's
    forwards through the stages before it and ends before its backwards through them: where every backward passes
    on its gradient as one B, ``P_s + m c_s`` for ``c_s`` its own and ``P_s`` theirs, which no split of the
    layers' ``T`` seconds into ``n`` stages keeps below ``T / (1 - (1 - 1/m)^n)``. On top, the collectives and the
    optimizer step of a rank with the mean of the parameters (the largest holds at least that), on the device
    that steps fastest.
    """
    o = setting.option
    m, layer = o.n_microbatches, [f + b for f, b in setting.seconds]
    total = sum(layer)
    pipeline = m * max(total / o.pp, *layer)
    if not _shape_of(setting).splits:
        pipeline = max(pipeline, total / (1 - (1 - 1 / m) ** setting.schedule.n_stages))
    mean = setting.layers.param_bytes / o.pp
    optimizer = min(optimizer_seconds([mean], [d], workload, o.fsdp) for d in setting.devices)
    return Overheads(sync_seconds([mean], o, cluster), optimizer, 0.0).step(pipeline * (1 - SLACK))


def pipeline_floor(setting: Setting, costs: StageCosts) -> float:
    """Seconds that ``setting``'s schedule takes at least on stages that cost ``costs``: no rank starts a stage's
    first forward before one micro-batch has passed the stages before it, nor ends before its last backward has
    passed them back, and in between it runs its stages' ``m`` forwards and backwards one at a time (with a split
    backward, its forwards and input passes before the last one passes back)."""
    schedule, m = setting.schedule, setting.option.n_microbatches
    splits = _shape_of(setting).splits
    n = schedule.n_stages
    crossing = [costs.transfer[j] if schedule.rank_of(j) != schedule.rank_of(j + 1) else 0.0 for j in range(n - 1)]
    back = costs.input_grad if splits else costs.backward
    fill, drain = [0.0], [0.0]
    for j in range(n - 1):
        fill.append(fill[-1] + costs.forward[j] + crossing[j])
        drain.append(drain[-1] + back[j] + crossing[j])
    floor = 0.0
    for rank in range(schedule.n_ranks):
        mine = schedule.stages_of(rank)
        first = min(mine)
        busy = m * sum(costs.forward[s] + costs.backward[s] for s in mine)
        if splits:
            passing = m * sum(costs.forward[s] + costs.input_grad[s] for s in mine) + drain[first]
            floor = max(floor, fill[first] + max(busy, passing))
        else:
            floor = max(floor, fill[first] + busy + drain[first])
    return floor * (1 - SLACK)


def can_fit(setting: Setting) -> bool:
    """Whether some split of ``setting``'s layers could fit each stage's capacity.

    Each range of layers is costed under what its stage holds: its fixed bytes (a tied parameter's left out) and
    its saved activations (a tensor two neighbours save left out) for the micro-batches the stage holds in flight
    at its peak, no pooled gradients; at most what the memory model counts. False only where no split fits those
    bounds, so where :func:`~stagewise.plan.evaluate.partitioned` finds none either.
    """
    costs, state = setting.costs, setting.state
    fixed = np.array([c.param_bytes * state + c.buffer_bytes for c in costs], dtype=np.float64)
    for tie in setting.layers.shared:
        fixed[list(tie.indices)] -= tie.nbytes * state
    kept = np.array([float(c.saved_bytes) - float(c.shared_bytes) for c in costs], dtype=np.float64)
    fixed_sums = np.concatenate(([0.0], np.cumsum(fixed)))
    kept_sums = np.concatenate(([0.0], np.cumsum(kept)))
    held = fixed_sums[None, :] - fixed_sums[:, None]  # [start, stop]: the fixed bytes of layers start:stop
    saved = kept_sums[None, :] - kept_sums[:, None]
    scale = float(np.abs(fixed).sum() + np.abs(kept).sum())
    ahead = np.triu(np.ones_like(held, dtype=bool), k=1)  # stop > start: no stage is empty
    reached = np.zeros(len(costs) + 1, dtype=bool)
    reached[0] = True
    for stage, peak in enumerate(_shape_of(setting).peaks):
        limit = setting.capacities[stage]
        tolerance = MEMORY_SLACK * limit + SLACK * scale * max(peak, 1)
        fits = ahead & (held + peak * saved <= limit + tolerance)
        reached = (reached[:, None] & fits).any(axis=0)
    return bool(reached[-1])
