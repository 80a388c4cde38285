"""How well ``stagewise plan`` predicts expert parallelism on this machine: pp2 x dp2 with ep=2 (and ep=1) on 4 gloo
ranks.

The model is a mixture-of-experts GPT built here (:data:`CONFIG`: 4 blocks, the first dense, 8 routed experts of
hidden width 512, top 2, one shared expert; 2048 tokens of vocabulary), so that the experts' compute, not the
executor's overhead, is most of a step. Before each layout the cluster is measured on its ranks, as
``benchmarks/shard_plan_fidelity.py`` does (gloo's all-reduce latency and ring bandwidth between two ranks, what DDP
and the experts' all-to-all are costed at, and the all-to-all's own latency and bandwidth for the record), and the
layers are profiled by as many processes at once as the layout runs (``stagewise plan --profile --profile-ranks``),
as this machine's load drifts. The planner evaluates the layout (1F1B, ``--microbatches``: 4); the pipeline runs it
with the planner's partition on ``init_mesh(ep=)``. ``--layout 1x2`` runs pp1 x dp2 on 2 processes, one core each.

Each rank measures its median step time, its memory at its fullest (the training state it holds between steps:
its parameters, with its ``1/ep`` share of the experts, their gradients and AdamW's state; and the most bytes
autograd saved for backward at once), the token choices its experts received in each forward, and the seconds of
the forward's dispatch beside the experts' compute (the all-to-alls and the wait for the other rank). The routing's
measured imbalance is, per MoE layer and micro-batch, the choices the busiest rank of an ep group received over the
group's mean, averaged: :attr:`stagewise.plan.workload.Workload.expert_imbalance` as measured. One JSON line per
layout: predicted (with the planner's default imbalance, and with the measured one on the same partition), measured,
and their ratios, for the step and for each rank's memory.

    python benchmarks/moe_plan_fidelity.py [--steps 12] [--layout 2x2] [--eps 2,1]
        [--batch 16] [--seq-len 128] [--microbatches 4]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import statistics
import time
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.distributed as dist
from pipeline_bench import saved_bytes
from shard_memory import held_bytes
from shard_plan_fidelity import memory_rows

from stagewise.comm import init_mesh, launch
from stagewise.models import GPTConfig
from stagewise.models import moe as moe_module
from stagewise.models.moe import MoEConfig
from stagewise.partition import Partition
from stagewise.pipeline import LossFn, Pipeline, PipelineOptions
from stagewise.pipeline.config import Loss
from stagewise.pipeline.parallel import expert_parallel
from stagewise.plan import Option, evaluate
from stagewise.plan.cluster import Cluster, Device
from stagewise.plan.evaluate import measured as evaluated
from stagewise.plan.evaluate import overheads, timed
from stagewise.plan.rejection import Rejection
from stagewise.plan.setting import Settings
from stagewise.plan.workload import Built, Workload, workload_under_load
from stagewise.run.objective import objective
from stagewise.schedule import simulate

CONFIG = GPTConfig(
    vocab_size=2048, seq_len=128, d_model=256, n_layers=4, n_heads=4,
    moe=MoEConfig(experts=8, top_k=2, d_expert=512, shared_experts=1, dense_layers=1),
)  # fmt: skip
"""The benchmark's model: 13.3M parameters, 9.4M of them in the routed experts."""


def moe_model(micro_batch: int, seq_len: int) -> Built:
    """:data:`CONFIG` on the meta device, one micro-batch of its input, and its loss with a target."""
    sample, target = CONFIG.example(micro_batch, seq_len), CONFIG.target(micro_batch, seq_len)
    return CONFIG.build(device="meta"), sample, (cast(LossFn, CONFIG.loss), target)


def links() -> dict[str, float]:
    """gloo between ranks 0 and 1 (2 and 3 alongside, where there are 4): the all-reduce's latency and ring bandwidth
    per rank, and the all-to-all's latency and bandwidth (bytes each rank sends to the other per second)."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    pair = [dist.new_group([r, r + 1]) for r in range(0, dist.get_world_size(), 2)][rank // 2]

    def seconds(op: Any, numel: int, repeats: int) -> float:
        x, y = torch.ones(numel), torch.empty(numel)
        op(x, y)
        times = []
        for _ in range(repeats):
            began = time.perf_counter()
            op(x, y)
            times.append(time.perf_counter() - began)
        return statistics.median(times)

    def reduce(x: torch.Tensor, _: torch.Tensor) -> None:
        dist.all_reduce(x, group=pair)

    def exchange(x: torch.Tensor, y: torch.Tensor) -> None:
        dist.all_to_all_single(y, x, group=pair)

    size = 4 * 2**20  # 16 MiB of fp32
    latency = seconds(reduce, 1, 50)
    bandwidth = (4 * size) / (seconds(reduce, size, 10) - latency)  # 2 ranks: 2 (n-1)/n = 1 of the bytes each way
    a2a_latency = seconds(exchange, 2, 50)
    a2a_bandwidth = (4 * size / 2) / (seconds(exchange, size, 10) - a2a_latency)  # half of it goes to the other
    dist.destroy_process_group()
    return {"latency": latency, "bandwidth": bandwidth, "all_to_all_latency": a2a_latency,
            "all_to_all_bandwidth": a2a_bandwidth}  # fmt: skip


TRACKED = 2
"""The last steps run with autograd's saved-tensor hooks to measure activations; the others are timed."""


def _instrumented(received: list[int], dispatch: list[float]) -> None:
    """Record the token choices each experts' call receives, and the seconds of each forward dispatch beside it."""
    forward = moe_module.Experts.forward
    call = expert_parallel.AllToAllDispatch.__call__
    inside = [0.0]

    def experts(self: moe_module.Experts, tokens: torch.Tensor, counts: Any) -> torch.Tensor:
        received.append(int(tokens.shape[0]))
        began = time.perf_counter()
        out = forward(self, tokens, counts)
        inside[0] += time.perf_counter() - began
        return out

    def dispatched(self: expert_parallel.AllToAllDispatch, *args: Any) -> torch.Tensor:
        inside[0] = 0.0
        began = time.perf_counter()
        out = call(self, *args)
        dispatch.append(time.perf_counter() - began - inside[0])
        return out

    moe_module.Experts.forward = experts  # type: ignore[method-assign]
    expert_parallel.AllToAllDispatch.__call__ = dispatched  # type: ignore[method-assign,assignment]


@dataclass(frozen=True)
class Run:
    """One layout's training run."""

    pp: int
    dp: int
    ep: int
    microbatches: int
    batch: int
    seq_len: int
    steps: int
    bounds: tuple[int, ...]


def _held(pipe: Pipeline) -> list[torch.nn.Parameter]:
    """The parameters the stages' layers read."""
    return [p for stage in pipe.stages.values() for p in stage.parameters()]


def measured(run: Run) -> dict[str, Any]:
    """One rank of ``run`` training AdamW steps with clipping on random tokens: its step times (and their pipeline,
    clipping and optimizer parts), the state it holds between steps, its peak saved activations, the token choices
    its experts received per call and the forward dispatch's seconds per step."""
    torch.set_num_threads(1)
    received: list[int] = []
    dispatch: list[float] = []
    _instrumented(received, dispatch)
    mesh = init_mesh(run.pp, run.dp, ep=run.ep)
    goal = objective(CONFIG)
    pipe = Pipeline(
        CONFIG.build(device="meta"), Partition.from_bounds(run.bounds), schedule="1f1b",
        n_microbatches=run.microbatches,
        loss_fn=goal.loss_fn, mesh=mesh,
        options=PipelineOptions(loss=Loss(reduction=goal.reduction, ignore_index=goal.ignore_index)),
    )  # fmt: skip
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, CONFIG.vocab_size, (run.batch, run.seq_len + 1), generator=g)
    mine = data[mesh.share(run.batch)]
    times, held, peaks, dispatched = [], [], [], []
    parts: list[tuple[float, float, float]] = []  # the pipeline's step, clipping and the optimizer's, per step
    for step in range(run.steps):
        if step:
            held.append(held_bytes(list(pipe.parameters()), optimizer))
        began = time.perf_counter()
        dispatch.clear()
        optimizer.zero_grad()
        tracked = step >= run.steps - TRACKED
        with saved_bytes(functools.partial(_held, pipe)) if tracked else nullcontext([0]) as peak:
            pipe.step(mine[:, :-1], mine[:, 1:])
        piped = time.perf_counter()
        pipe.clip_grad_norm_(1.0)
        clipped = time.perf_counter()
        optimizer.step()
        if tracked:
            peaks.append(peak[0])
        else:
            times.append(time.perf_counter() - began)
            dispatched.append(sum(dispatch))
            parts.append((piped - began, clipped - piped, time.perf_counter() - clipped))
    pipe.close()
    dist.destroy_process_group()
    return {"steps": times, "saved": max(peaks), "state": max(held), "received": received,
            "dispatch": statistics.median(dispatched[2:]) if len(dispatched) > 2 else 0.0,
            "parts": [statistics.median(p[i] for p in parts[2:]) for i in range(3)]}  # fmt: skip


def imbalance(ranks: dict[int, dict[str, Any]], groups: list[list[int]]) -> list[float]:
    """Per experts' call of each ep group (same layer, same micro-batch, on each rank in the same order): the choices
    its busiest rank received over the group's mean."""
    out = []
    for group in groups:
        calls = zip(*(ranks[r]["received"] for r in group), strict=True)
        out += [max(c) / statistics.mean(c) for c in calls if sum(c)]
    return out


def at_partition(option: Option, work: Workload, cluster: Cluster, part: Partition) -> Option:
    """``option`` evaluated as :func:`~stagewise.plan.evaluate` does, but on the partition ``part``."""
    setting = Settings(work, cluster).of(option)
    assert not isinstance(setting, Rejection), setting
    result = simulate(setting.schedule, timed(setting, part, cluster), cores=setting.cores)
    return evaluated(setting, part, result, overheads(setting, part, work, cluster), work, cluster)


def _load() -> float:
    """This machine's 1-minute load average (other work on its cores slows the measured and the profiled alike)."""
    with open("/proc/loadavg") as f:
        return float(f.read().split()[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--eps", default="2,1", help="expert-parallel degrees, comma-separated")
    parser.add_argument("--layout", default="2x2", help="pp x dp: pp * dp processes")
    ns = parser.parse_args()
    pp, dp = (int(v) for v in ns.layout.split("x"))
    m, n = ns.microbatches, pp * dp
    for ep in (int(v) for v in ns.eps.split(",")):
        # Measured again for each layout, just before it runs: this machine's load drifts.
        began = _load()
        link = launch(links, n)[0]
        work = workload_under_load(
            moe_model, (ns.batch // dp // m, ns.seq_len), concurrent=n, global_batch=ns.batch, measure_on="cpu"
        )
        cluster = Cluster(
            (Device(64 * 2**30, 1e11),) * n, link_bandwidth=1.5e9, link_latency=link["latency"],
            network_bandwidth=link["bandwidth"], gpus_per_node=4, intra_node_bandwidth=link["bandwidth"],
            host_cores=len(os.sched_getaffinity(0)),  # the 4 ranks take turns on this machine's cores
        )  # fmt: skip
        layout = Option(pp, dp, 1, m, "1f1b", False, ep=ep)
        option = evaluate(layout, work, cluster)
        assert option.partition is not None, option.rejected
        run = Run(pp, dp, ep, m, ns.batch, ns.seq_len, ns.steps, option.partition.bounds)
        ranks = launch(measured, n, run)
        ended = _load()
        loads = imbalance(ranks, [list(range(s * dp, (s + 1) * dp)) for s in range(pp)]) if ep > 1 else []
        load = statistics.mean(loads) if loads else 1.0
        work_at = dataclasses.replace(work, expert_imbalance=max(1.0, load))
        at_load = at_partition(layout, work_at, cluster, option.partition)
        held = tuple(dataclasses.replace(c, working_bytes=0) for c in work_at.costs)
        saved = at_partition(layout, dataclasses.replace(work_at, costs=held, loss_bytes=None), cluster,
                             option.partition).rank_activation  # fmt: skip
        state = [total - acts for total, acts in zip(at_load.rank_memory, at_load.rank_activation, strict=True)]
        setting = Settings(work_at, cluster).of(layout)
        assert not isinstance(setting, Rejection), setting
        extra = overheads(setting, option.partition, work_at, cluster)
        extra_free = at_load.step_time - extra.step(0.0)
        step = statistics.median(statistics.median(rank["steps"][2:]) for rank in ranks.values())
        rows = memory_rows(state, saved, ranks, per_stage=dp)
        print(json.dumps({
            "bench": "moe_plan_fidelity", "layout": option.describe(),
            "partition": list(option.partition.bounds),
            "links": {k: float(f"{v:.4g}") for k, v in link.items()},
            "load_1min": [began, ended],
            "profiled_s": [round(c.time or 0.0, 4) for c in work.costs],
            "imbalance": {"mean": round(load, 3), "max": round(max(loads, default=1.0), 3)},
            "predicted_step_s_default_imbalance": round(option.step_time, 4),
            "predicted_step_s": round(at_load.step_time, 4), "measured_step_s": round(step, 4),
            "step_ratio": round(at_load.step_time / step, 3),
            "measured_steps_s": [round(s, 3) for s in ranks[0]["steps"]],
            "predicted_parts_s": {"pipeline": round(extra_free, 4), "sync": round(extra.sync, 4),
                                  "optimizer": round(extra.optimizer, 4), "experts_sync": round(extra.experts, 4)},
            "measured_parts_s": [[round(x, 4) for x in rank["parts"]] for rank in ranks.values()],
            "measured_dispatch_s": [round(rank["dispatch"], 4) for rank in ranks.values()],
            "memory": rows,
        }), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
