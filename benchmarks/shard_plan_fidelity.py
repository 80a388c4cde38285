"""How well ``stagewise plan`` predicts sharded layouts on this machine: pp2 x fsdp2 and pp2 x tp2 on 4 gloo ranks.

The cluster is measured first, on the 4 ranks: the ring bandwidth and latency of gloo's all-reduce between two
of them (what tensor parallelism's collectives run on here), the bandwidth of its all-gather and reduce-scatter
of 64 MiB shards (FSDP's; gloo's run at about a quarter of its all-reduce's), and the layers' times profiled by 4
processes at once (``stagewise plan --profile --profile-ranks 4``), as the 4 training ranks share the cores. The
planner evaluates each layout (1F1B, ``--microbatches``: 4, as with 2 a third of the step is the bubble, where
half of the 4 processes have the 2 cores and run faster than profiled); ``train`` then runs it with the
planner's partition. FSDP's all-gather and reduce-scatter are timed inside the step too.
Each rank measures its median step time and its memory at its fullest: the training state it holds between steps
(its shards of the parameters, their gradients and AdamW's state), the whole parameters and gradients FSDP holds
during a step, and the most bytes autograd saved for backward at once (every tensor's storage once, the
parameters excluded). One JSON line per layout: predicted, measured and their ratio, for the step and for each
rank's memory (the planner's state plus saved activations, without the loss's moment of working tensors, which
neither side counts here).

    python benchmarks/shard_plan_fidelity.py [--preset gpt-small] [--batch 8] [--steps 8] [--microbatches 4]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import statistics
import time
from collections.abc import Sequence
from contextlib import nullcontext
from typing import Any

import torch
import torch.distributed as dist
from pipeline_bench import saved_bytes
from shard_memory import held_bytes
from torch.distributed.tensor import DTensor

from stagewise.comm import launch
from stagewise.pipeline import Pipeline
from stagewise.pipeline.parallel.fully_sharded import ShardedStages
from stagewise.plan import Option, evaluate
from stagewise.plan.cluster import Cluster, Device
from stagewise.plan.workload import preset_model, workload_under_load
from stagewise.run import TrainConfig, build_pipeline


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _held(pipe: Pipeline) -> list[torch.nn.Parameter]:
    """The parameters the stages' layers read now: FSDP's whole ones during a step."""
    return [p for stage in pipe.stages.values() for p in stage.parameters()]


def ring() -> dict[str, float]:
    """gloo's all-reduce between ranks 0 and 1 (2 and 3 alongside): latency, and the ring bandwidth per rank."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    pair = [dist.new_group([0, 1]), dist.new_group([2, 3])][rank // 2]

    def seconds(numel: int, repeats: int) -> float:
        x = torch.ones(numel)
        dist.all_reduce(x, group=pair)
        times = []
        for _ in range(repeats):
            began = time.perf_counter()
            dist.all_reduce(x, group=pair)
            times.append(time.perf_counter() - began)
        return statistics.median(times)

    latency = seconds(1, 50)
    size = 4 * 2**20  # 16 MiB of fp32
    bandwidth = (4 * size) / (seconds(size, 10) - latency)  # 2 ranks: 2 (n-1)/n = 1 of the bytes each way
    shard = torch.ones(16 * 2**20)  # 64 MiB: FSDP's collectives move a stage's parameters at once
    whole = torch.empty(2 * shard.numel())
    dist.all_gather_into_tensor(whole, shard, group=pair)
    began = time.perf_counter()
    for _ in range(3):
        dist.all_gather_into_tensor(whole, shard, group=pair)
        dist.reduce_scatter_tensor(shard, whole, group=pair)
    sharding = 6 * 4 * shard.numel() / (time.perf_counter() - began)  # each moves the shard's bytes, 2 ranks
    dist.destroy_process_group()
    return {"latency": latency, "bandwidth": bandwidth, "sharding_bandwidth": sharding}


TRACKED = 2
"""The last steps run with autograd's saved-tensor hooks to measure activations; the others are timed."""


def measured(config: TrainConfig) -> dict[str, Any]:
    """One rank of ``config``'s layout training AdamW steps with clipping on random tokens: its step times, the
    state it holds between steps with the whole copies FSDP adds during one, and its peak saved activations."""
    torch.set_num_threads(1)
    whole: list[int] = []
    collectives: list[float] = []  # seconds of FSDP's all-gather and reduce-scatter, per step
    reduce, gather = ShardedStages.reduce, ShardedStages.gather

    def counting(self: ShardedStages) -> None:  # the whole parameters and gradients, just before they go
        tensors = [p for s in self.stages.values() for p in s.parameters()]
        tensors += [p.grad for p in tensors if p.grad is not None]
        whole.append(sum(_local(t).untyped_storage().nbytes() for t in tensors))
        began = time.perf_counter()
        reduce(self)
        collectives[-1] += time.perf_counter() - began

    def timed_gather(self: ShardedStages) -> None:
        began = time.perf_counter()
        gather(self)
        collectives.append(time.perf_counter() - began)

    ShardedStages.reduce = counting  # type: ignore[method-assign]
    ShardedStages.gather = timed_gather  # type: ignore[method-assign]
    pipe = build_pipeline(config)
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, 50304, (config.batch_size, config.seq_len + 1), generator=g)
    mine = data[pipe.mesh.share(config.batch_size)]
    times, held, peaks = [], [], []
    for step in range(config.steps):
        if step:
            held.append(held_bytes(list(pipe.parameters()), optimizer))
        began = time.perf_counter()
        optimizer.zero_grad()
        tracked = step >= config.steps - TRACKED
        with saved_bytes(functools.partial(_held, pipe)) if tracked else nullcontext([0]) as peak:
            pipe.step(mine[:, :-1], mine[:, 1:])
        pipe.clip_grad_norm_(1.0)
        optimizer.step()
        if tracked:
            peaks.append(peak[0])
        else:
            times.append(time.perf_counter() - began)
    pipe.close()
    dist.destroy_process_group()
    timed = collectives[: len(times)]
    return {
        "steps": times, "saved": max(peaks), "state": max(held) + (max(whole) if whole else 0),
        "collectives": statistics.median(timed[2:]) if len(timed) > 2 else 0.0,
    }  # fmt: skip


def memory_rows(
    state: Sequence[float], saved: Sequence[float], ranks: dict[int, dict[str, Any]], *, per_stage: int
) -> list[dict[str, Any]]:
    """Each rank's memory, predicted (its stage's ``state`` and ``saved`` bytes) against measured (its ``"state"``
    and ``"saved"``), with their ratios; ranks ``r`` hold stage ``r // per_stage``."""
    rows = []
    for r in sorted(ranks):
        stage = r // per_stage
        predicted = state[stage] + saved[stage]
        got = ranks[r]["state"] + ranks[r]["saved"]
        rows.append({
            "rank": r, "predicted_mib": round(predicted / 2**20, 1), "measured_mib": round(got / 2**20, 1),
            "ratio": round(predicted / got, 3), "state_ratio": round(state[stage] / ranks[r]["state"], 3),
            "saved_ratio": round(saved[stage] / ranks[r]["saved"], 3),
        })  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="gpt-small")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--layouts", default="2x1x2x1,2x1x1x2", help="pp x dp x fsdp x tp, comma-separated")
    ns = parser.parse_args()
    link = launch(ring, 4)[0]
    for pp, dp, fsdp, tp in (tuple(int(v) for v in text.split("x")) for text in ns.layouts.split(",")):
        shards = dp * fsdp
        m = ns.microbatches
        work = workload_under_load(
            preset_model, (ns.preset, ns.batch // shards // m, ns.seq_len), concurrent=4, global_batch=ns.batch,
            measure_on="cpu",
        )  # fmt: skip
        cluster = Cluster(
            (Device(64 * 2**30, 1e11),) * 4, link_bandwidth=1.5e9, link_latency=link["latency"],
            network_bandwidth=link["bandwidth"], gpus_per_node=4, intra_node_bandwidth=link["bandwidth"],
            host_cores=len(os.sched_getaffinity(0)),  # the 4 ranks take turns on this machine's cores
            sharding_bandwidth=link["sharding_bandwidth"],
        )  # fmt: skip
        layout = Option(pp, dp, 1, m, "1f1b", False, fsdp=fsdp, tp=tp)
        option = evaluate(layout, work, cluster)
        free = evaluate(layout, work, dataclasses.replace(cluster, sharding_bandwidth=1e18))  # collectives cost 0
        assert option.partition is not None, option.rejected
        held = tuple(dataclasses.replace(c, working_bytes=0) for c in work.costs)
        saved = evaluate(layout, dataclasses.replace(work, costs=held, loss_bytes=None), cluster).rank_activation
        state = [total - acts for total, acts in zip(option.rank_memory, option.rank_activation, strict=True)]
        config = TrainConfig(
            model=ns.preset, pp=pp, dp=dp, fsdp=fsdp, tp=tp, microbatches=m, batch_size=ns.batch,
            seq_len=ns.seq_len, steps=ns.steps, warmup=1, eval_every=0, partition=option.partition.bounds, clip=1.0,
            checkpoint_dir=None,
        )  # fmt: skip
        ranks = launch(measured, 4, config)
        step = statistics.median(ranks[0]["steps"][2:])
        rows = memory_rows(state, saved, ranks, per_stage=4 // pp)
        print(json.dumps({
            "bench": "shard_plan_fidelity", "preset": ns.preset, "layout": option.describe(),
            "partition": list(option.partition.bounds), "ring": link,
            "predicted_step_s": round(option.step_time, 4), "measured_step_s": round(step, 4),
            "step_ratio": round(option.step_time / step, 3),
            "predicted_collectives_s": round(option.step_time - free.step_time, 4),
            "measured_collectives_s": [round(rank["collectives"], 4) for rank in ranks.values()],
            "memory": rows,
        }), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
