"""How well ``stagewise plan --profile`` predicts ``stagewise train``: step time and each rank's peak activations.

For each preset, the planner profiles the layers on this machine's CPU (one
thread per process, in 2 processes at once, as the 2 training ranks run;
``stagewise plan --profile --profile-ranks 2``) and evaluates one layout: 2 pipeline
ranks, dp 1, 1F1B with 4 micro-batches. Then ``train`` runs that layout, with
the planner's partition, on 2 local gloo processes; each rank records the
largest total of tensors autograd saved for backward during its steps (the
same measure as benchmarks/pipeline_bench.py). One JSON line per preset with
predicted, measured and their ratio.

With ``--device cuda`` (one GPU) the planner profiles on the GPU and
evaluates a single stage (1F1B, 4 micro-batches); ``train`` runs it there with
NCCL, and the row adds the planned memory of the stage (weights, gradients,
optimizer state, activations and the loss's working tensors) against
``torch.cuda.max_memory_allocated`` over the training steps.

    python benchmarks/plan_fidelity.py [--presets gpt-tiny,gpt-small] [--steps 8]
    python benchmarks/plan_fidelity.py --device cuda [--presets gpt-small]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
from typing import Any

import torch
from pipeline_bench import saved_bytes

from stagewise.comm import launch
from stagewise.pipeline import Pipeline
from stagewise.plan import Option, evaluate
from stagewise.plan.cluster import Cluster, Device
from stagewise.plan.workload import preset_model, workload_under_load
from stagewise.run import TrainConfig, train

SHAPES = {"gpt-tiny": (32, 128), "gpt-small": (8, 128)}
"""Global batch and sequence length per preset on the CPU."""

GPU_SHAPES = {"gpt-tiny": (64, 128), "gpt-small": (32, 1024)}
"""Global batch and sequence length per preset on one GPU."""

GLOO = Cluster(
    (Device(64 * 2**30, 1e11),) * 2,
    link_bandwidth=1.5e9,  # gloo over loopback on this machine: benchmarks/p2p_bench.py
    link_latency=2e-4,
)


TRACKED = 2
"""The last steps run with autograd's saved-tensor hooks to measure activations; the others are timed."""


def measured(config: TrainConfig) -> dict[str, Any]:
    """One rank of the training run: its step times and peak saved activations."""
    torch.set_num_threads(1)
    peaks: list[int] = []

    def instrument(pipe: Pipeline) -> None:
        step = pipe.step
        calls = [0]

        def tracked(inputs: Any, targets: Any = None) -> torch.Tensor:
            calls[0] += 1
            if calls[0] <= config.steps - TRACKED:
                return step(inputs, targets)
            with saved_bytes(pipe.parameters) as peak:
                loss = step(inputs, targets)
            peaks.append(peak[0])
            return loss

        pipe.step = tracked  # type: ignore[method-assign]

    trained: list[int] = []  # the peak over the training steps, before the evaluation after the last

    def stepped(step: int, loss: float, seconds: float) -> None:
        if step == config.steps and torch.cuda.is_available():
            trained.append(torch.cuda.max_memory_allocated())

    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    summary = train(config, on_start=instrument, on_step=stepped)
    allocated = trained[0] if trained else None
    torch.distributed.destroy_process_group()
    return {"steps": summary.step_seconds, "peak": max(peaks), "max_memory_allocated": allocated}


def gpu_cluster() -> Cluster:
    """This machine's one GPU (its speed is only relative here: every time is measured on it)."""
    return Cluster((Device(float(torch.cuda.get_device_properties(0).total_memory), 1e14),))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", default="gpt-tiny,gpt-small")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ns = parser.parse_args()
    gpu = ns.device == "cuda"
    for name in ns.presets.split(","):
        batch, seq = (GPU_SHAPES if gpu else SHAPES)[name]
        m, pp = 4, 1 if gpu else 2
        # On the CPU, profiled by 2 processes at once, as the 2 training ranks share this machine's cores.
        work = workload_under_load(
            preset_model, (name, batch // m, seq), concurrent=pp, global_batch=batch, measure_on=ns.device
        )
        layout, cluster = Option(pp, 1, 1, m, "1f1b", False), gpu_cluster() if gpu else GLOO
        option = evaluate(layout, work, cluster)
        # What autograd saves, as measured: the planner's activations without what one micro-batch holds for a
        # moment (the loss's tensors, a layer's backward).
        held = tuple(dataclasses.replace(c, working_bytes=0) for c in work.costs)
        saved = evaluate(layout, dataclasses.replace(work, costs=held, loss_bytes=None), cluster).rank_activation
        assert option.partition is not None, option.rejected
        config = TrainConfig(
            model=name, pp=pp, microbatches=m, batch_size=batch, seq_len=seq, steps=ns.steps, warmup=1,
            eval_every=0, partition=option.partition.bounds, clip=1.0,
        )  # fmt: skip
        if gpu:
            torch.cuda.empty_cache()
        ranks = launch(measured, pp, config, device="auto" if gpu else "cpu")
        skip = 2  # the first steps warm up allocators and caches
        step = statistics.median(ranks[0]["steps"][skip:-TRACKED])
        row = {
            "bench": "plan_fidelity",
            "preset": name,
            "layout": option.describe(),
            "partition": list(option.partition.bounds),
            "predicted_step_s": round(option.step_time, 4),
            "measured_step_s": round(step, 4),
            "step_ratio": round(option.step_time / step, 3),
            "predicted_activation_mib": [round(a / 2**20, 2) for a in saved],
            "measured_activation_mib": [round(ranks[r]["peak"] / 2**20, 2) for r in range(pp)],
            "activation_ratio": [round(saved[r] / ranks[r]["peak"], 3) for r in range(pp)],
        }
        if gpu:
            allocated = ranks[0]["max_memory_allocated"]
            row["device"] = torch.cuda.get_device_name(0)
            row["predicted_memory_mib"] = round(option.rank_memory[0] / 2**20, 1)
            row["max_memory_allocated_mib"] = round(allocated / 2**20, 1)
            row["memory_ratio"] = round(option.rank_memory[0] / allocated, 3)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
