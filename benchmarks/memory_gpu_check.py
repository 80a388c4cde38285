"""One-device check of the memory options: each equals the unsplit model, and what it saves and costs on the GPU.

On one rank (CUDA with NCCL where a GPU is visible, else the CPU with gloo, so the script is exercised on any
machine) the unsplit reference, a GPT preset materialised from a seed, trains ``--steps`` SGD steps; then each
case trains a ``Pipeline`` of the same preset, built on the meta device, and is compared step by step:
whole-layer and selective activation checkpointing under 1F1B, under zero-bubble's split backward and under ZBV
(two stages on the rank), activation offload to pinned host memory (alone and with selective checkpointing),
and FSDP's per-micro-batch gathering and optimizer offload on a shard of one. One JSON line per case: the largest
errors against the reference, ``torch.cuda.max_memory_allocated`` over its steps, the bytes the activation offload
moved to the host, and the median step time.

    python benchmarks/memory_gpu_check.py [--preset gpt-small] [--seq-len 1024] [--batch 8] [--microbatches 4]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from typing import Any

import torch
from gpu_check import SEED, TOLERANCE, batches, lm_loss, train_unsplit
from torch.distributed.tensor import DTensor

from stagewise.comm import init_mesh, launch
from stagewise.models import GPT, PRESETS
from stagewise.models.gpt import GPTConfig
from stagewise.partition import Partition
from stagewise.pipeline import Compute, FullySharded, Pipeline, PipelineOptions, SelectiveCheckpointing

LR = 0.05


def largest_difference(named: Any, want: dict[str, torch.Tensor], grad: bool) -> float:
    """The largest absolute difference of the parameters (or their gradients) from ``want``, DTensors made whole."""
    worst = 0.0
    for name, p in named:
        got = p.grad if grad else p.detach()
        if got is None:
            raise AssertionError(f"{name} has no gradient after the pipeline's step")
        whole = got.full_tensor() if isinstance(got, DTensor) else got
        worst = max(worst, float((whole.cpu() - want[name]).abs().max()))
    return worst


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    schedule: str = "1f1b"
    virtual: int = 1
    compute: Compute = dataclasses.field(default_factory=Compute)
    sharded: FullySharded | None = None


CASES = (
    Case("1f1b"),
    Case("1f1b, full checkpointing", compute=Compute(activation_checkpointing=True)),
    Case("1f1b, selective checkpointing", compute=Compute(activation_checkpointing=SelectiveCheckpointing())),
    Case("zero-bubble"),
    Case("zero-bubble, full checkpointing", "zero-bubble", compute=Compute(activation_checkpointing=True)),
    Case(
        "zero-bubble, selective checkpointing",
        "zero-bubble",
        compute=Compute(activation_checkpointing=SelectiveCheckpointing()),
    ),
    Case("zbv, full checkpointing", "zbv", 2, compute=Compute(activation_checkpointing=True)),
    Case("1f1b, activation offload", compute=Compute(offload_activations=True)),
    Case(
        "1f1b, selective checkpointing and activation offload",
        compute=Compute(activation_checkpointing=SelectiveCheckpointing(), offload_activations=True),
    ),
    Case("1f1b, FSDP gathered per micro-batch", sharded=FullySharded(gather="micro-batch")),
    Case("1f1b, optimizer state offloaded", sharded=FullySharded(offload=True)),
)


def _run(case: Case, config: GPTConfig, args: argparse.Namespace, mesh: Any, reference: Any) -> dict[str, object]:
    device = mesh.device
    n_layers = config.n_layers + 3
    bounds = (0, n_layers) if case.virtual == 1 else (0, 3, n_layers)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    options = PipelineOptions(
        n_virtual=case.virtual, seed=SEED, compute=case.compute, fully_sharded=case.sharded or "auto"
    )
    pipe = Pipeline(
        GPT(config, device="meta"), Partition.from_bounds(bounds), schedule=case.schedule,  # type: ignore[arg-type]
        n_microbatches=args.microbatches, loss_fn=lm_loss, mesh=mesh, options=options,
    )  # fmt: skip
    optimizer = torch.optim.SGD(pipe.parameters(), lr=LR, momentum=0.9)
    loss_error = grad_error = 0.0
    times = []
    for step, (ids, targets) in enumerate(batches(config, args.batch, args.steps, device)):
        began = time.perf_counter()
        optimizer.zero_grad()
        loss = pipe.step(ids, targets)
        loss_error = max(loss_error, abs(loss.item() - reference.losses[step]))
        grad_error = max(grad_error, largest_difference(pipe.named_parameters(), reference.grads[step], True))
        optimizer.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - began)
    param_error = largest_difference(pipe.named_parameters(), reference.final, False)
    moved = sum(s.offload.moved_bytes for s in pipe._runtime.stages.values() if s.offload is not None)
    pipe.close()
    return {
        "case": case.name, "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "loss_error": loss_error, "max_grad_error": grad_error, "max_param_error": param_error,
        "equal": max(loss_error, grad_error, param_error) < TOLERANCE,
        "max_memory_allocated_mib": round(torch.cuda.max_memory_allocated(device) / 2**20, 1)
        if device.type == "cuda" else None,
        "offloaded_mib_per_step": round(moved / args.steps / 2**20, 1),
        "step_s": round(statistics.median(times[1:] or times), 4),
    }  # fmt: skip


def check(args: argparse.Namespace) -> list[dict[str, object]]:
    torch.set_num_threads(1)
    mesh = init_mesh(1, timeout=120)
    config = dataclasses.replace(PRESETS[args.preset], seq_len=args.seq_len)
    assert isinstance(config, GPTConfig)
    reference = train_unsplit(config, args.batch, args.steps, mesh.device)
    rows = []
    for case in CASES:
        try:
            rows.append(_run(case, config, args, mesh, reference))
        except Exception as err:  # one failing case is reported, the others still run
            rows.append({"case": case.name, "error": f"{type(err).__name__}: {err}"})
    torch.distributed.destroy_process_group()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--preset", default="gpt-tiny", choices=[n for n, c in PRESETS.items() if isinstance(c, GPTConfig)]
    )
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3, help="SGD steps, each compared with the unsplit model")
    args = parser.parse_args()
    for row in launch(check, 1, args, device="auto")[0]:
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
