"""One-device check of Pipeline: each schedule on one rank equals the unsplit model; peak memory per schedule.

Runs on CUDA with NCCL when a GPU is visible (world size 1), else on the CPU
with gloo, so the same script is exercised on any machine. For each schedule
(interleaved puts two stages on the one rank, handed over without
communication) it trains a GPT-tiny built on the meta device for one step,
compares loss and every gradient with the unsplit model materialised from
the same seed, and reports torch.cuda.max_memory_allocated on CUDA. One JSON
line per schedule:

    python benchmarks/gpu_check.py [--microbatches 4] [--batch 8]
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from stagewise.comm import init_mesh, launch
from stagewise.models import GPT, PRESETS
from stagewise.partition import Partition
from stagewise.pipeline import Pipeline, materialise_model


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def check(m: int, batch: int) -> list[dict[str, object]]:
    torch.set_num_threads(1)
    mesh = init_mesh(1, timeout=120)
    device = mesh.device
    config = PRESETS["gpt-tiny"]
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, config.vocab_size, (batch, config.seq_len), generator=g).to(device)
    targets = torch.randint(0, config.vocab_size, (batch, config.seq_len), generator=g).to(device)
    reference = materialise_model(GPT(config, device="meta"), device=device, seed=3)
    want_loss = lm_loss(reference(ids), targets)
    want_loss.backward()
    want = {n: p.grad for n, p in reference.named_parameters()}
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
            n_microbatches=m, n_virtual=virtual, loss_fn=lm_loss, mesh=mesh, seed=3,
        )  # fmt: skip
        loss = pipe.step(ids, targets)
        worst = max(
            float((p.grad - want[name]).abs().max()) for name, p in pipe.named_parameters() if p.grad is not None
        )
        rows.append(
            {
                "schedule": schedule,
                "device": str(device),
                "backend": mesh.backend,
                "loss_error": abs(loss.item() - want_loss.item()),
                "max_grad_error": worst,
                "equal": abs(loss.item() - want_loss.item()) < 1e-5 and worst < 1e-5,
                "max_memory_allocated_mib": round(torch.cuda.max_memory_allocated(device) / 2**20, 1)
                if device.type == "cuda"
                else None,
            }
        )
    torch.distributed.destroy_process_group()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8)
    args = parser.parse_args()
    for row in launch(check, 1, args.microbatches, args.batch, device="auto")[0]:
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
