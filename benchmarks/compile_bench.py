"""Compiled stages against eager ones: step time of a GPT of width 1024 on 2 gloo ranks, and the graphs compiled.

Each schedule runs in the same launch, on the same model, partition and batches, one intra-op thread per rank,
three ways: eager (large linear weights' gradients fused into the backward, the default), eager with autograd
accumulating every weight gradient (as a compiled graph does) and compiled (``Compute(compile=True)``:
inductor). A rank times ``--steps`` steps after ``--warmup`` (the first compiles). One JSON line per schedule:
the median step of each (the slower rank's), the ratios (eager / compiled: above 1 means compiling pays), the
seconds the first compiled step took (compilation included) and the graphs each rank had compiled after the
first step and after the last (equal: nothing recompiles for equal shapes).

    python benchmarks/compile_bench.py [--d-model 1024] [--layers 4] [--batch 8] [--seq 128] [--steps 6]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

from stagewise.comm import init_mesh, launch
from stagewise.models.gpt import GPTConfig
from stagewise.partition import auto
from stagewise.pipeline import Compute, Pipeline, PipelineOptions, WeightGradientFusion

VARIANTS = ("eager", "eager unfused", "compiled")
"""Eager as by default (large linear weights' gradients fused into the backward), eager with autograd accumulating
every weight gradient (as a compiled graph does), and compiled."""


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(1)
    torch._inductor.config.compile_threads = 1  # two ranks already take both cores
    mesh = init_mesh(2, timeout=900)
    config = GPTConfig(vocab_size=1024, seq_len=args.seq, d_model=args.d_model, n_layers=args.layers,
                       n_heads=args.d_model // 64)  # fmt: skip
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, config.vocab_size, (args.batch, args.seq), generator=g)
    targets = torch.roll(ids, -1, dims=1)
    torch.manual_seed(0)
    part = auto(config.build(device="meta"), 2, ids[:1], by="flops")
    out: dict[str, Any] = {"bounds": list(part.bounds)}
    for schedule in args.schedules:
        for variant in VARIANTS:
            torch.manual_seed(0)
            options = PipelineOptions(compute=Compute(compile=variant == "compiled"))
            if variant == "eager unfused":
                options = dataclasses.replace(options, fuse_weight_gradients=WeightGradientFusion.off())
            pipe = Pipeline(
                config.build(device="meta"), part, schedule=schedule, n_microbatches=args.microbatches,
                loss_fn=GPTConfig.loss, mesh=mesh, options=options,
            )  # fmt: skip
            opt = torch.optim.AdamW(pipe.parameters(), lr=1e-4)
            times, graphs = [], []
            for _ in range(args.warmup + args.steps):
                dist.barrier()
                began = time.perf_counter()
                opt.zero_grad()
                pipe.step(ids, targets)
                opt.step()
                times.append(time.perf_counter() - began)
                graphs.append(pipe.compiled_graphs)
            pipe.close()
            out[f"{schedule} {variant}"] = {
                "median_s": statistics.median(times[args.warmup :]),
                "first_s": times[0],
                "graphs_after_first_step": graphs[0],
                "graphs_after_last_step": graphs[-1],
            }
    dist.destroy_process_group()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--d-model", type=int, default=1024)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--schedules", nargs="+", default=["1f1b", "zero-bubble"])
    args = p.parse_args()
    results = launch(run, 2, args)
    for schedule in args.schedules:
        # The slower rank sets the step.
        step = {v: max(results[r][f"{schedule} {v}"]["median_s"] for r in results) for v in VARIANTS}
        compiled = [results[r][f"{schedule} compiled"] for r in sorted(results)]
        print(json.dumps({
            "benchmark": "compile", "schedule": schedule, "d_model": args.d_model, "layers": args.layers,
            "batch": args.batch, "seq": args.seq, "microbatches": args.microbatches,
            "bounds": results[0]["bounds"],
            **{f"{v.replace(' ', '_')}_step_s": round(t, 4) for v, t in step.items()},
            "speedup_vs_eager": round(step["eager"] / step["compiled"], 3),
            "speedup_vs_eager_unfused": round(step["eager unfused"] / step["compiled"], 3),
            "first_compiled_step_s": round(max(c["first_s"] for c in compiled), 1),
            "graphs_per_rank": [[c["graphs_after_first_step"], c["graphs_after_last_step"]] for c in compiled],
        }))  # fmt: skip


if __name__ == "__main__":
    main()
