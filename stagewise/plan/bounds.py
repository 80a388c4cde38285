"""Lower bounds of a layout's step time, and whether any split of its layers can fit: what lets a search skip it.

Each bound holds for every partition and is a little under the exact figure (by :data:`SLACK`), so a layout whose
bound is slower than the ``top``-th fastest found cannot be among the ``top`` fastest; one whose stages can hold the
layers under no split is one that :func:`~stagewise.plan.evaluate.evaluate` rejects.
"""

from __future__ import annotations

import numpy as np

from stagewise.plan.cluster import Cluster
from stagewise.plan.evaluate import Overheads
from stagewise.plan.rank_memory import offloaded
from stagewise.plan.setting import ScheduleShape, Setting, cached_holdings, cached_shape, splits_backward
from stagewise.plan.time_model import expert_sync_seconds, optimizer_seconds, sync_seconds
from stagewise.plan.workload import Workload
from stagewise.schedule import StageCosts
from stagewise.schedule.holdings import Holding

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
    that steps fastest, and the routed experts' all-reduce of a rank with the mean of theirs. Where ranks share a
    machine's cores, the pipeline's part at the speed of a rank computing alone.
    """
    o = setting.option
    m, layer = o.n_microbatches, [f + b for f, b in setting.seconds]
    total = sum(layer)
    pipeline = m * max(total / o.pp, *layer)
    if not splits_backward(o.schedule, o.n_virtual):
        pipeline = max(pipeline, total / (1 - (1 - 1 / m) ** setting.n_stages))
    mean = setting.layers.param_bytes / o.pp
    experts = sum(setting.layers.expert_bytes) / o.pp  # the routed experts' share a rank holds, on the mean
    optimizer = min(optimizer_seconds([mean], [d], workload, o, cluster, unsharded=[experts]) for d in setting.devices)
    extra = Overheads(sync_seconds([mean], o, cluster), optimizer, 0.0, expert_sync_seconds(experts, o, cluster))
    return extra.step(pipeline / _fastest(setting) * (1 - SLACK))


def pipeline_floor(setting: Setting, costs: StageCosts) -> float:
    """Seconds that ``setting``'s schedule takes at least on stages that cost ``costs``: no rank starts a stage's
    first forward before one micro-batch has passed the stages before it, nor ends before its last backward has
    passed them back, and in between it runs its stages' ``m`` forwards and backwards one at a time (with a split
    backward, its forwards and input passes before the last one passes back); where ranks share a machine's cores,
    all of it at the speed of a rank computing alone."""
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
    return floor / _fastest(setting) * (1 - SLACK)


def _fastest(setting: Setting) -> float:
    """The most that sharing a machine's cores speeds an action up against its costs (1 where each rank has its
    own device): no bound may assume the costs' speed where a rank alone runs faster."""
    return 1.0 if setting.cores is None else max(1.0, setting.cores.fastest)


def _moments(setting: Setting) -> tuple[tuple[Holding, ...], ...]:
    """Per stage: moments that bound what it holds from below, cheap to work out: with a split backward its
    holdings (micro-batches in flight and waiting for W), else its peak in flight alone."""
    o = setting.option
    if not splits_backward(o.schedule, o.n_virtual):
        return tuple((Holding(peak),) for peak in setting.peaks)
    ckpt = o.activation_checkpointing is not False
    moments = cached_holdings(o.schedule, setting.n_stages, o.n_microbatches, o.n_virtual, ckpt, False)
    return offloaded(moments) if o.offload_activations else moments


def can_fit(setting: Setting) -> bool:
    """Whether some split of ``setting``'s layers could fit each stage's capacity (:func:`_fits`): first with each
    stage holding one micro-batch in flight, which every schedule's stages do at some moment (no schedule is
    built for it), then at each stage's fullest moments."""
    one = tuple((Holding(1),) for _ in range(setting.n_stages))
    return _fits(setting, one) and _fits(setting, _moments(setting))


def _fits(setting: Setting, every: tuple[tuple[Holding, ...], ...]) -> bool:
    """Whether some split of ``setting``'s layers could fit each stage's capacity, each stage holding what
    ``every`` moment of it says.

    Each range of layers is costed under what its stage holds: its fixed bytes (a tied parameter's left out) and,
    at each moment that can be its fullest, its saved activations (a tensor two neighbours save left out) for the
    micro-batches it holds in flight and, with a split backward, its pooled bytes for those waiting for W (a
    weight-gradient pool left out); at most what the memory model counts. False only where no split fits those
    bounds, so where :func:`~stagewise.plan.evaluate.partitioned` finds none either.
    """
    sums = setting.layers.range_sums
    held = setting.state * sums.params + sums.buffers
    scale = setting.state * sums.param_scale + sums.scale
    reached = np.zeros(len(setting.costs) + 1, dtype=bool)
    reached[0] = True
    fitting: dict[tuple[float, tuple[Holding, ...]], np.ndarray] = {}
    for stage in range(setting.n_stages):
        limit, moments = setting.capacities[stage], every[stage]
        fits = fitting.get((limit, moments))
        if fits is None:
            most = max(max(h.in_flight, h.pooled) for h in moments)
            tolerance = MEMORY_SLACK * limit + SLACK * scale * max(most, 1)
            fullest = np.max([h.in_flight * sums.kept + h.pooled * sums.pooled for h in moments], axis=0)
            fits = fitting[(limit, moments)] = sums.ahead & (held + fullest <= limit + tolerance)
        reached = (reached[:, None] & fits).any(axis=0)
    return bool(reached[-1])
