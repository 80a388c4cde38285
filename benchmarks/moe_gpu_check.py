"""One-device check of the mixture-of-experts GPT: the pipeline equals the unsplit model on the GPU, and its time.

On one rank (CUDA with NCCL where a GPU is visible, else the CPU with gloo, so the script runs anywhere) the
unsplit MoE GPT, materialised from a seed, trains ``--steps`` SGD steps; then a ``Pipeline`` of the same model,
built on the meta device, trains them under 1F1B (one stage) and DualPipeV (two stages on the rank), and is
compared step by step: losses (with the load-balancing term), gradients and parameters. One JSON line per
schedule: the largest errors, the median step time and ``torch.cuda.max_memory_allocated``. Expert parallelism
needs a GPU per rank: on a machine with 4, ``benchmarks/moe_overlap.py`` runs it with NCCL.

    python benchmarks/moe_gpu_check.py [--d-model 512] [--layers 8] [--experts 16] [--seq-len 256] [--batch 8]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch
from gpu_check import LR, SEED, TOLERANCE

from stagewise.comm import init_mesh, launch
from stagewise.models.gpt import GPT, GPTConfig
from stagewise.models.moe import MoEConfig, auxiliary_loss
from stagewise.partition import Partition
from stagewise.pipeline import Pipeline, PipelineOptions, materialise_model


def _batches(config: GPTConfig, batch: int, steps: int, device: torch.device) -> list[tuple[torch.Tensor, ...]]:
    g = torch.Generator().manual_seed(0)
    return [
        tuple(torch.randint(0, config.vocab_size, (batch, config.seq_len), generator=g).to(device) for _ in range(2))
        for _ in range(steps)
    ]


def _reference(config: GPTConfig, data: list[tuple[torch.Tensor, ...]], device: torch.device) -> dict[str, Any]:
    model = materialise_model(GPT(config, device="meta"), device=device, seed=SEED)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    losses, grads = [], []
    for ids, targets in data:
        optimizer.zero_grad()
        loss = GPTConfig.loss(model(ids), targets)
        loss.backward()
        losses.append(float(loss.detach()) + float(auxiliary_loss(model)))
        grads.append({n: p.grad.detach().cpu().clone() for n, p in model.named_parameters()})
        optimizer.step()
    return {"losses": losses, "grads": grads, "params": {n: p.detach().cpu() for n, p in model.named_parameters()}}


def check(config: GPTConfig, batch: int, m: int, steps: int) -> list[dict[str, Any]]:
    torch.set_num_threads(1)
    mesh = init_mesh(1, timeout=120)
    device = mesh.device
    data = _batches(config, batch, steps, device)
    want = _reference(config, data, device)
    n = config.n_layers + 3
    rows = []
    for schedule, bounds, virtual in (("1f1b", (0, n), 1), ("dualpipev", (0, n // 2, n), 2)):
        pipe = Pipeline(
            GPT(config, device="meta"), Partition.from_bounds(bounds), schedule=schedule, n_microbatches=m,
            loss_fn=GPTConfig.loss, mesh=mesh, options=PipelineOptions(n_virtual=virtual, seed=SEED),
        )  # fmt: skip
        optimizer = torch.optim.SGD(pipe.parameters(), lr=LR, momentum=0.9)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        loss_error = grad_error = 0.0
        times = []
        for step, (ids, targets) in enumerate(data):
            optimizer.zero_grad()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            began = time.perf_counter()
            loss = float(pipe.step(ids, targets))
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - began)
            loss_error = max(loss_error, abs(loss - want["losses"][step]))
            for name, p in pipe.named_parameters():
                assert p.grad is not None, f"{name} has no gradient"
                grad_error = max(grad_error, float((p.grad.cpu() - want["grads"][step][name]).abs().max()))
            optimizer.step()
        param_error = max(float((p.detach().cpu() - want["params"][n]).abs().max()) for n, p in pipe.named_parameters())
        peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
        pipe.close()
        rows.append({
            "device": str(device), "schedule": schedule, "loss_error": loss_error, "grad_error": grad_error,
            "param_error": param_error, "equal": max(loss_error, grad_error, param_error) <= TOLERANCE * 10,
            "median_step_s": round(statistics.median(times[1:] or times), 4), "max_memory_allocated": peak,
        })  # fmt: skip
    mesh.close()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--steps", type=int, default=4)
    ns = parser.parse_args()
    config = GPTConfig(
        vocab_size=1024, seq_len=ns.seq_len, d_model=ns.d_model, n_layers=ns.layers, n_heads=8,
        moe=MoEConfig(experts=ns.experts, top_k=2, shared_experts=1, dense_layers=1),
    )  # fmt: skip
    for row in launch(check, 1, config, ns.batch, ns.microbatches, ns.steps)[0]:
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
