"""One-device check of sharding inside stages: FSDP's bf16 policy on a single-rank mesh, against the same Pipeline
without FSDP, in fp32 and under bf16 autocast.

On CUDA with NCCL when a GPU is visible (world size 1), else on the CPU with gloo. A GPT preset trains ``--steps``
AdamW steps with clipping on one stage (1F1B and zero-bubble, ``--microbatches`` each) four ways: fp32 (the
reference), bf16 autocast, FSDP's ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` through
``PipelineOptions(fully_sharded=...)`` on a mesh of one rank, and FSDP in fp32 on that mesh (which must equal
the reference). One JSON line per schedule and way: the losses, the largest loss difference from fp32, the median
step time and the peak memory allocated (CUDA only).

    python benchmarks/shard_gpu_check.py [--preset gpt-small] [--seq-len 1024] [--batch 8] [--steps 6]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch

from stagewise.comm import init_mesh, launch
from stagewise.models import build
from stagewise.models.gpt import GPTConfig
from stagewise.partition import Partition, layers_of
from stagewise.pipeline import Compute, FullySharded, Pipeline, PipelineOptions

WAYS = {
    "fp32": PipelineOptions(),
    "bf16-autocast": PipelineOptions(compute=Compute(autocast=torch.bfloat16)),
    "fsdp-bf16": PipelineOptions(fully_sharded=FullySharded(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)),
    "fsdp-fp32": PipelineOptions(fully_sharded=FullySharded()),
}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def check(ns: argparse.Namespace) -> list[dict[str, Any]]:
    torch.set_num_threads(1)
    mesh = init_mesh(1, timeout=600)
    device = mesh.device
    config = build(ns.preset, device="meta").config
    g = torch.Generator().manual_seed(0)
    data = [torch.randint(0, config.vocab_size, (ns.batch, ns.seq_len + 1), generator=g) for _ in range(ns.steps)]
    rows = []
    for schedule in ("1f1b", "zero-bubble"):
        for way, options in WAYS.items():
            torch.manual_seed(1)
            model = build(ns.preset, device="meta")
            pipe = Pipeline(
                model, Partition.from_bounds((0, len(layers_of(model)))), schedule=schedule,  # type: ignore[arg-type]
                n_microbatches=ns.microbatches, loss_fn=GPTConfig.loss, mesh=mesh, options=options,
            )  # fmt: skip
            opt = torch.optim.AdamW(pipe.parameters(), lr=3e-4)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            losses, times = [], []
            for ids in data:
                began = time.perf_counter()
                opt.zero_grad()
                losses.append(float(pipe.step(ids[:, :-1], ids[:, 1:])))
                pipe.clip_grad_norm_(1.0)
                opt.step()
                _sync(device)
                times.append(time.perf_counter() - began)
            peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
            rows.append({
                "preset": ns.preset, "schedule": schedule, "way": way, "device": str(device), "losses": losses,
                "step_seconds": statistics.median(times[1:] or times), "peak_bytes": peak,
            })  # fmt: skip
            pipe.close()
            del pipe, opt
    for row in rows:
        reference = next(r for r in rows if r["schedule"] == row["schedule"] and r["way"] == "fp32")
        pairs = zip(row["losses"], reference["losses"], strict=True)
        row["largest_loss_difference"] = max(abs(a - b) for a, b in pairs)
    mesh.close()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="gpt-small")
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--steps", type=int, default=6)
    ns = parser.parse_args()
    device = "auto" if torch.cuda.is_available() else "cpu"
    for row in launch(check, 1, ns, device=device)[0]:
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
