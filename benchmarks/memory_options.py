"""What each memory option buys, and how well ``stagewise plan`` predicts it: 4 gloo processes, pp2 x fsdp2 or pp4.

Each case trains the preset a few AdamW steps with clipping on random tokens with one option changed from the
baseline (1F1B, nothing recomputed; FSDP gathering once per step, or no FSDP with ``--pp 4``): whole-layer or
selective activation checkpointing, zero-bubble's split backward alone and with selective checkpointing, and FSDP
gathering per micro-batch (under 1F1B, one stage per rank, and interleaved 1F1B, two). Each rank measures its memory
at its fullest during the last step, as ``torch.cuda.max_memory_allocated`` would on a GPU: the tensors it holds as
the step starts (its shards of the parameters and AdamW's state), plus the most bytes the step's ops allocated at
once (activations, kept and recomputed ones, gradients, whole gradients FSDP accumulates, buffers, every storage
once while alive: :class:`~stagewise.partition.live_bytes.LiveBytes`), plus the whole parameters FSDP gathered, at
their most (``ShardedStages.peak_bytes``: FSDP resizes storages outside the ops). The planner evaluates the same
layout with the same partition; one JSON line per case: each rank's predicted and measured bytes and their ratio,
the reduction against the baseline, the whole parameters at their most, and (with ``--timed``) the step time
predicted and measured.

Offloading is not measured here: on a CPU the activations and the optimizer state are in host memory already,
and nothing moves (see ``benchmarks/gpu_checks.sh`` for the device).

    python benchmarks/memory_options.py [--preset gpt-small] [--batch 8] [--seq-len 128] [--microbatches 4] [--pp 2]
        [--timed]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
from shard_memory import held_bytes
from shard_plan_fidelity import ring

from stagewise.comm import launch
from stagewise.partition.live_bytes import LiveBytes
from stagewise.plan import Option, evaluate
from stagewise.plan.cluster import Cluster, Device
from stagewise.plan.workload import preset_model, workload_under_load
from stagewise.run import TrainConfig, build_pipeline


@dataclasses.dataclass(frozen=True)
class Case:
    """One option changed from the baseline."""

    name: str
    schedule: str = "1f1b"
    virtual: int = 1
    checkpointing: bool | str = False
    gather: str = "step"


CASES = (
    Case("baseline"),
    Case("full checkpointing", checkpointing=True),
    Case("selective checkpointing", checkpointing="selective"),
    Case("zero-bubble", schedule="zero-bubble"),
    Case("zero-bubble selective", schedule="zero-bubble", checkpointing="selective"),
    Case("gather per micro-batch", gather="micro-batch"),
    Case("interleaved gather per step", schedule="interleaved-1f1b", virtual=2),
    Case("interleaved gather per micro-batch", schedule="interleaved-1f1b", virtual=2, gather="micro-batch"),
)


def measured(config: TrainConfig) -> dict[str, Any]:
    """One rank training ``config``: its memory at its fullest in the last step, its parts, and its step times."""
    torch.set_num_threads(1)
    pipe = build_pipeline(config)
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, 50304, (config.batch_size, config.seq_len + 1), generator=g)
    mine = data[pipe.mesh.share(config.batch_size)]
    sharded = pipe._runtime.sharded
    times: list[float] = []
    held = peak = whole = 0
    phases: dict[str, int] = {}
    for step in range(config.steps):
        optimizer.zero_grad()
        last = step == config.steps - 1
        if last:
            held = held_bytes(list(pipe.parameters()), optimizer)
            if sharded is not None:
                sharded.reset_peak()
        began = time.perf_counter()
        live = LiveBytes() if last else None
        if live is not None:
            with live:
                pipe.step(mine[:, :-1], mine[:, 1:])
                phases["pipeline"] = live.peak
                live.peak = live.current
                pipe.clip_grad_norm_(1.0)
                phases["clip"] = live.peak
                live.peak = live.current  # the optimizer's moment: the gradients and its state, no activations
                optimizer.step()
                phases["optimizer"] = live.peak
            peak = max(phases.values())
            whole = sharded.peak_bytes if sharded is not None else 0
        else:
            pipe.step(mine[:, :-1], mine[:, 1:])
            pipe.clip_grad_norm_(1.0)
            optimizer.step()
            times.append(time.perf_counter() - began)
    pipe.close()
    dist.destroy_process_group()
    return {
        "held": held,
        "allocated": peak,
        "whole": whole,
        "total": held + peak + whole,
        "steps": times,
        "phases": phases,
    }


def _option(case: Case, m: int, pp: int) -> Option:
    """``case`` on 4 ranks: ``pp`` pipeline ranks, the rest FSDP shards."""
    return Option(
        pp, 1, case.virtual, m, case.schedule, case.checkpointing, fsdp=4 // pp,  # type: ignore[arg-type]
        fsdp_gather=case.gather,  # type: ignore[arg-type]
    )  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="gpt-small")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--steps", type=int, default=2, help="steps per case; the last one is measured")
    parser.add_argument("--timed", action="store_true", help="also predict and measure the step time")
    parser.add_argument("--predict-only", action="store_true", help="print the planner's predictions, train nothing")
    parser.add_argument("--pp", type=int, default=2, choices=(2, 4), help="pipeline ranks; the other ranks shard")
    parser.add_argument("--cases", default=",".join(c.name for c in CASES), help="comma-separated case names")
    ns = parser.parse_args()
    link = launch(ring, 4)[0]  # the cluster's collectives, measured on the 4 ranks
    m = ns.microbatches
    work = workload_under_load(
        preset_model, (ns.preset, ns.batch // (4 // ns.pp) // m, ns.seq_len), concurrent=4, global_batch=ns.batch,
        measure_on="cpu",
    )  # fmt: skip
    cluster = Cluster(
        (Device(64 * 2**30, 1e11),) * 4, link_bandwidth=1.5e9, link_latency=link["latency"],
        network_bandwidth=link["bandwidth"], gpus_per_node=4, intra_node_bandwidth=link["bandwidth"],
        sharding_bandwidth=link["sharding_bandwidth"], host_cores=len(os.sched_getaffinity(0)),
        side_stream=False,  # gloo on CPUs: per-action gathers and scatters add to the compute, as `plan` assumes there
    )  # fmt: skip
    wanted = ns.cases.split(",")
    baseline: list[float] = []
    for case in (c for c in CASES if c.name in wanted and (ns.pp == 2 or c.gather == "step")):  # pp4: no FSDP
        option = evaluate(_option(case, m, ns.pp), work, cluster)
        if option.partition is None:
            print(json.dumps({"bench": "memory_options", "case": case.name, "rejected": option.rejected}))
            continue
        if ns.predict_only:
            print(json.dumps({
                "bench": "memory_options", "preset": ns.preset, "case": case.name, "layout": option.describe(),
                "partition": list(option.partition.bounds), "predicted_step_s": round(option.step_time, 3),
                "predicted_mib": [round(b / 2**20, 1) for b in option.rank_memory],
            }), flush=True)  # fmt: skip
            continue
        config = TrainConfig(
            model=ns.preset, pp=ns.pp, fsdp=4 // ns.pp, virtual=case.virtual, schedule=case.schedule,  # type: ignore[arg-type]
            activation_checkpointing=case.checkpointing, fsdp_gather=case.gather,  # type: ignore[arg-type]
            microbatches=m, batch_size=ns.batch, seq_len=ns.seq_len, steps=ns.steps, warmup=1, eval_every=0,
            partition=option.partition.bounds, clip=1.0, checkpoint_dir=None,
        )  # fmt: skip
        ranks = launch(measured, 4, config)
        totals = [ranks[r]["total"] for r in range(4)]
        if case.name == "baseline":
            baseline = totals
        rows = []
        for r in range(4):
            stage = r // (4 // ns.pp)  # pp=2: ranks 0, 1 are pipeline rank 0's shards, 2, 3 rank 1's
            predicted = option.rank_memory[stage]
            rows.append({
                "rank": r, "predicted_mib": round(predicted / 2**20, 1), "measured_mib": round(totals[r] / 2**20, 1),
                "ratio": round(predicted / totals[r], 3),
                "predicted_activations_mib": round(option.rank_activation[stage] / 2**20, 1),
                "held_mib": round(ranks[r]["held"] / 2**20, 1),
                "allocated_mib": round(ranks[r]["allocated"] / 2**20, 1),
                "allocated_pipeline_mib": round(ranks[r]["phases"]["pipeline"] / 2**20, 1),
                "allocated_optimizer_mib": round(ranks[r]["phases"]["optimizer"] / 2**20, 1),
                "whole_parameters_mib": round(ranks[r]["whole"] / 2**20, 1),
                "vs_baseline": round(totals[r] / baseline[r], 3) if baseline else None,
            })  # fmt: skip
        line: dict[str, Any] = {
            "bench": "memory_options", "preset": ns.preset, "case": case.name, "layout": option.describe(),
            "partition": list(option.partition.bounds), "memory": rows,
        }  # fmt: skip
        if ns.timed and ranks[0]["steps"][1:]:
            step = statistics.median(ranks[0]["steps"][1:])
            line |= {
                "predicted_step_s": round(option.step_time, 3), "measured_step_s": round(step, 3),
                "step_ratio": round(option.step_time / step, 3),
            }  # fmt: skip
        print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
