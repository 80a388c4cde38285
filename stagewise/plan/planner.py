"""plan(): the fastest layout that fits — pipeline depth, data parallelism, micro-batches, schedule, checkpointing."""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from typing import Any, get_args

from stagewise.plan.cluster import Cluster
from stagewise.plan.evaluate import cached_schedule, evaluate
from stagewise.plan.option import Option, Plan
from stagewise.plan.workload import Workload
from stagewise.schedule import BUILDERS, ScheduleName

log = logging.getLogger(__name__)


_ONE_STAGE: ScheduleName = "1f1b"
"""What a single stage runs: with one stage every schedule is the same gradient accumulation."""
_VIRTUAL = 2
"""Stages per rank that a :attr:`~stagewise.schedule.Builder.virtual` (interleaved) schedule is tried with."""


def _layouts(pp: int, m: int) -> list[tuple[ScheduleName, int, bool]]:
    """(schedule, stages per rank, activation checkpointing) worth trying with ``pp`` ranks and ``m`` micro-batches:
    every built-in schedule that takes that shape (the builders say which run several stages per rank)."""
    out = []
    for name in get_args(ScheduleName):
        if pp == 1 and name != _ONE_STAGE:
            continue
        v = _VIRTUAL if BUILDERS[name].virtual else 1
        try:
            schedule = cached_schedule(name, pp * v, m, v)
        except ValueError:  # a shape the schedule cannot take (interleaved: m a multiple of pp)
            continue
        # A split backward (zero-bubble) does not combine with checkpointing: Pipeline refuses it.
        out += [(name, v, ckpt) for ckpt in ((False,) if schedule.splits_backward else (False, True))]
    return out


def candidates(n_devices: int, n_layers: int, global_batch: int, *, max_microbatches: int = 64) -> list[Option]:
    """Every layout worth simulating on ``n_devices``: pp x dp = n_devices, m, schedule, checkpointing."""
    out = []
    for pp in (d for d in range(1, n_devices + 1) if n_devices % d == 0 and d <= n_layers):
        dp = n_devices // pp
        local = global_batch // dp if global_batch % dp == 0 else 0
        top = min(local, max_microbatches)
        ms = [m for m in range(1, top + 1) if local % m == 0 and (m & (m - 1) == 0 or m == top)]
        for m in ms or [1]:
            out += [Option(pp, dp, v, m, name, ckpt) for name, v, ckpt in _layouts(pp, m)]
    return out


def plan(workload: Workload, cluster: Cluster, *, options: Sequence[Option] | None = None) -> Plan:
    """Evaluate every candidate layout (or ``options``) and rank the feasible ones by step time.

    Each candidate gets the exact partition under the devices' memory
    capacities and speeds (:func:`stagewise.partition.balance`), the step time
    of its schedule simulated with per-stage compute, the transfer of boundary
    activations over ``cluster.link_bandwidth``, DDP's ring all-reduce over
    ``cluster.network_bandwidth`` and the optimizer step, and the peak memory of
    every pipeline rank. A plan never proposes a layout whose predicted memory
    exceeds a device's capacity.
    """
    considered = list(options) if options is not None else candidates(
        cluster.n_devices, len(workload.costs), workload.global_batch
    )  # fmt: skip
    done = [evaluate(o, workload, cluster) for o in considered]
    feasible = sorted((o for o in done if o.rejected is None), key=lambda o: (o.step_time, max(o.rank_memory)))
    rejected = tuple(o for o in done if o.rejected is not None)
    smallest = None
    if not feasible:
        needs = [max(o.rank_memory) for o in rejected if o.rank_memory]
        smallest = min(needs) if needs else None
    log.info("planned %d layouts: %d fit", len(done), len(feasible))
    return Plan(tuple(feasible), rejected, smallest)


def load_plan(text: str) -> dict[str, Any]:
    """A plan written by :meth:`Plan.to_json`, checked for the fields ``train --plan`` needs."""
    data = json.loads(text)
    if isinstance(data, dict) and "bounds" in data and "stages" not in data:
        raise ValueError(
            f"this is a partition (stagewise partition --json: the stage bounds {data['bounds']} alone), not a plan, "
            "which also holds the model, the layout and the batch; write one with `stagewise plan --json PLAN`, "
            "or pass the bounds to train as TrainConfig(partition=...)"
        )
    need = ("model", "stages", "dp", "virtual", "schedule", "microbatches", "batch_size", "partition")
    missing = [k for k in need if k not in data]
    if missing:
        raise ValueError(f"the plan lacks {missing}; write it with `stagewise plan --json`")
    return dict(data)
