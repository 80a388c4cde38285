"""One-device check of Pipeline: each schedule on one rank equals the unsplit model; peak memory per schedule.

Runs on CUDA with NCCL when a GPU is visible (world size 1), else on the CPU
with gloo, so the same script is exercised on any machine. The unsplit
reference, a GPT preset materialised from a seed, trains ``--steps`` SGD
steps on a batch that ``--microbatches`` need not divide; its losses,
gradients and final parameters are kept on the CPU and the reference is
freed. Then for each schedule (interleaved puts two stages on the one rank,
handed over without communication) a Pipeline of the same model, built on
the meta device, trains the same steps and is compared with it; on CUDA the
row reports ``torch.cuda.max_memory_allocated`` over that schedule's steps.
One JSON line per schedule:

    python benchmarks/gpu_check.py [--preset gpt-tiny] [--microbatches 4] [--batch 10] [--seq-len 128]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from stagewise.comm import init_mesh, launch
from stagewise.models import GPT, PRESETS
from stagewise.models.gpt import GPTConfig
from stagewise.partition import Partition
from stagewise.pipeline import Pipeline, PipelineOptions, materialise_model

SEED = 3
LR = 0.05
"""SGD with momentum, as the equivalence tests train: Adam would divide a gradient's rounding noise by its own
near-zero scale and turn it into a whole step of difference."""
TOLERANCE = 1e-5
"""Largest absolute difference in fp32 counted as equal, as in the equivalence tests."""


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


@dataclasses.dataclass
class Reference:
    """What the unsplit model did: per step its loss and gradients, and its parameters at the end (on the CPU)."""

    losses: list[float]
    grads: list[dict[str, torch.Tensor]]
    final: dict[str, torch.Tensor]


def batches(config: GPTConfig, batch: int, steps: int, device: torch.device) -> Iterator[tuple[torch.Tensor, ...]]:
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        ids = torch.randint(0, config.vocab_size, (batch, config.seq_len), generator=g)
        targets = torch.randint(0, config.vocab_size, (batch, config.seq_len), generator=g)
        yield ids.to(device), targets.to(device)


def train_unsplit(config: GPTConfig, batch: int, steps: int, device: torch.device) -> Reference:
    model = materialise_model(GPT(config, device="meta"), device=device, seed=SEED)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    out = Reference([], [], {})
    for ids, targets in batches(config, batch, steps, device):
        optimizer.zero_grad()
        loss = lm_loss(model(ids), targets)
        loss.backward()
        out.losses.append(loss.item())
        out.grads.append({n: p.grad.cpu() for n, p in model.named_parameters() if p.grad is not None})
        optimizer.step()
    out.final = {n: p.detach().cpu() for n, p in model.named_parameters()}
    return out


def largest_difference(named: Iterator[tuple[str, nn.Parameter]], want: dict[str, torch.Tensor], grad: bool) -> float:
    worst = 0.0
    for name, p in named:
        got = p.grad if grad else p.detach()
        if got is None:
            raise AssertionError(f"{name} has no gradient after the pipeline's step")
        worst = max(worst, float((got.cpu() - want[name]).abs().max()))
    return worst


def check(preset: str, seq_len: int, m: int, batch: int, steps: int) -> list[dict[str, object]]:
    torch.set_num_threads(1)
    mesh = init_mesh(1, timeout=120)
    device = mesh.device
    config = dataclasses.replace(PRESETS[preset], seq_len=seq_len)
    assert isinstance(config, GPTConfig)
    reference = train_unsplit(config, batch, steps, device)
    rows: list[dict[str, object]] = []
    n_layers = config.n_layers + 3
    for schedule, bounds, virtual in (
        ("gpipe", (0, n_layers), 1),
        ("1f1b", (0, n_layers), 1),
        ("zero-bubble", (0, n_layers), 1),
        ("interleaved-1f1b", (0, 3, n_layers), 2),
    ):
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        pipe = Pipeline(
            GPT(config, device="meta"), Partition.from_bounds(bounds), schedule=schedule,  # type: ignore[arg-type]
            n_microbatches=m, loss_fn=lm_loss, mesh=mesh, options=PipelineOptions(n_virtual=virtual, seed=SEED),
        )  # fmt: skip
        optimizer = torch.optim.SGD(pipe.parameters(), lr=LR, momentum=0.9)
        loss_error = grad_error = 0.0
        for step, (ids, targets) in enumerate(batches(config, batch, steps, device)):
            optimizer.zero_grad()
            loss = pipe.step(ids, targets)
            loss_error = max(loss_error, abs(loss.item() - reference.losses[step]))
            grad_error = max(grad_error, largest_difference(pipe.named_parameters(), reference.grads[step], True))
            optimizer.step()
        param_error = largest_difference(pipe.named_parameters(), reference.final, False)
        rows.append(
            {
                "schedule": schedule,
                "preset": preset,
                "batch": batch,
                "seq_len": seq_len,
                "microbatches": m,
                "steps": steps,
                "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                "backend": mesh.backend,
                "loss_error": loss_error,
                "max_grad_error": grad_error,
                "max_param_error": param_error,
                "equal": max(loss_error, grad_error, param_error) < TOLERANCE,
                "max_memory_allocated_mib": round(torch.cuda.max_memory_allocated(device) / 2**20, 1)
                if device.type == "cuda"
                else None,
            }
        )
        del pipe, optimizer
    torch.distributed.destroy_process_group()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--preset", default="gpt-tiny", choices=[n for n, c in PRESETS.items() if isinstance(c, GPTConfig)]
    )
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--batch", type=int, default=10, help="samples per step; need not divide by --microbatches")
    parser.add_argument("--steps", type=int, default=3, help="SGD steps, each compared with the unsplit model")
    args = parser.parse_args()
    for row in launch(check, 1, args.preset, args.seq_len, args.microbatches, args.batch, args.steps, device="auto")[0]:
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
