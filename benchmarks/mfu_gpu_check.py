"""One GPU: model FLOPs utilisation, the executor's overhead and memory against the plan; dropout resumed exactly.

For each preset, a single-stage Pipeline (world size 1, NCCL) trains ``--steps`` AdamW steps of ``--batch``
sequences in ``--microbatches`` micro-batches, four ways: fp32 and bf16 autocast, each eager and compiled
(``Compute(compile=True)``). The same model runs the same micro-batches in the bare loop (gradient accumulation,
no Pipeline), compiled the same way. One JSON line per preset and way:

- ``mfu``: the model's FLOPs per step (``torch.utils.flop_counter`` on one micro-batch's forward and backward,
  times the micro-batches) over the median step time and ``--peak-flops`` (989e12: an H100 or H200's dense bf16;
  fp32 rows against the same figure, so they read as a fraction of the bf16 peak);
- ``overhead``: the Pipeline's median step over the bare loop's, less 1 (target at most 0.03);
- ``max_memory_allocated`` over the Pipeline's steps against ``plan``'s prediction for the same layout (1 stage,
  1F1B, the same micro-batches; fp32 rows, which is what the planner models).

Then a chain with dropout trains 4 steps on the GPU, checkpointed after 2; a fresh Pipeline loaded from that
checkpoint repeats steps 3 and 4, whose losses must equal the first run's bit for bit (the CUDA generator's
state is in the checkpoint). On a machine without a GPU it says so and exits 1.

    python benchmarks/mfu_gpu_check.py [--presets gpt-small,gpt-medium] [--batch 8] [--microbatches 4]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from stagewise import checkpoint
from stagewise.comm import init_mesh, launch
from stagewise.models import PRESETS
from stagewise.models.gpt import GPTConfig
from stagewise.partition import Partition, layers_of
from stagewise.pipeline import Compute, Pipeline, PipelineOptions
from stagewise.pipeline.stage.compiled import CompiledGraphs, compile_layers
from stagewise.plan import Option, evaluate
from stagewise.plan.cluster import Cluster, Device
from stagewise.plan.workload import workload

SEED = 3
WAYS = (("fp32", False), ("fp32", True), ("bf16", False), ("bf16", True))


def _batch(config: GPTConfig, batch: int, seq: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(SEED)
    ids = torch.randint(0, config.vocab_size, (batch, seq + 1), generator=g)
    return ids[:, :-1].to(device), ids[:, 1:].to(device)


def _timed(step: Callable[[], None], steps: int, warmup: int = 3) -> float:
    """The median seconds of ``step`` over ``steps`` runs after ``warmup`` (compilation among them)."""
    times = []
    for i in range(warmup + steps):
        torch.cuda.synchronize()
        began = time.perf_counter()
        step()
        torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - began)
    return statistics.median(times)


def _flops(config: GPTConfig, ids: torch.Tensor, targets: torch.Tensor, m: int, device: torch.device) -> int:
    """The model's FLOPs in one step: one micro-batch's forward and backward, counted, times ``m``."""
    torch.manual_seed(SEED)
    model = config.build(device=device)
    part_ids, part_targets = ids.tensor_split(m)[0], targets.tensor_split(m)[0]
    with FlopCounterMode(display=False) as counter:
        GPTConfig.loss(model(part_ids), part_targets).backward()
    return int(counter.get_total_flops()) * m


def _bare_loop(
    config: GPTConfig, ids: torch.Tensor, targets: torch.Tensor, m: int, bf16: bool, compiled: bool
) -> Callable[[], None]:
    """The same micro-batches through the unsplit model with gradient accumulation, and AdamW's step."""
    torch.manual_seed(SEED)
    model = config.build(device=ids.device)
    if compiled:
        compile_layers([layer.module for layer in layers_of(model)], CompiledGraphs("inductor"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    parts = list(zip(ids.tensor_split(m), targets.tensor_split(m), strict=True))

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        for x, y in parts:
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16):
                loss = GPTConfig.loss(model(x), y) * (x.shape[0] / ids.shape[0])
            loss.backward()
        opt.step()

    return step


def _planned_bytes(config: GPTConfig, batch: int, seq: int, m: int) -> int:
    """``plan``'s peak memory of the one rank for this layout (fp32 weights, AdamW, 1F1B over ``m``)."""
    model = config.build(device="meta")
    work = workload(model, config.example(batch // m, seq), global_batch=batch, tokens_per_sample=seq)
    total = torch.cuda.get_device_properties(0).total_memory
    option = evaluate(Option(1, 1, 1, m, "1f1b", False), work, Cluster((Device(total, 989e12),)))
    return int(max(option.rank_memory))


def check_preset(preset: str, args: argparse.Namespace, mesh: Any) -> list[dict[str, Any]]:
    device = torch.device("cuda")
    config = PRESETS[preset]
    assert isinstance(config, GPTConfig)
    seq, m = args.seq_len, args.microbatches
    ids, targets = _batch(config, args.batch, seq, device)
    flops = _flops(config, ids, targets, m, device)
    planned = _planned_bytes(config, args.batch, seq, m)
    rows = []
    for precision, compiled in WAYS:
        bf16 = precision == "bf16"
        torch.manual_seed(SEED)
        options = PipelineOptions(compute=Compute(autocast=torch.bfloat16 if bf16 else None, compile=compiled))
        model = config.build(device="meta")
        whole = Partition.from_bounds((0, len(layers_of(model))))
        pipe = Pipeline(model, whole, n_microbatches=m, loss_fn=GPTConfig.loss, mesh=mesh, options=options)
        opt = torch.optim.AdamW(pipe.parameters(), lr=1e-4, fused=True)

        def step(pipe: Pipeline = pipe, opt: torch.optim.Optimizer = opt) -> None:
            opt.zero_grad(set_to_none=True)
            pipe.step(ids, targets)
            opt.step()

        step()  # compiles, and allocates the optimizer's state, before the peak is measured
        torch.cuda.reset_peak_memory_stats()
        pipe_s = _timed(step, args.steps)
        allocated = torch.cuda.max_memory_allocated()
        graphs = pipe.compiled_graphs
        pipe.close()
        del pipe, opt
        bare_s = _timed(_bare_loop(config, ids, targets, m, bf16, compiled), args.steps)
        torch.cuda.empty_cache()
        row: dict[str, Any] = {
            "preset": preset, "precision": precision, "compiled": compiled, "batch": args.batch, "seq": seq,
            "microbatches": m, "step_s": round(pipe_s, 4), "bare_loop_s": round(bare_s, 4),
            "overhead": round(pipe_s / bare_s - 1, 4), "mfu": round(flops / pipe_s / args.peak_flops, 4),
            "bare_loop_mfu": round(flops / bare_s / args.peak_flops, 4), "graphs": graphs,
            "max_memory_allocated_gib": round(allocated / 2**30, 3),
        }  # fmt: skip
        if not bf16:
            row["planned_gib"] = round(planned / 2**30, 3)
            row["allocated_over_planned"] = round(allocated / planned, 3)
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


class _Dropped(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.drop = nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.drop(F.gelu(self.fc(x)))
        return out


def _dropout_run(mesh: Any, folder: Path, *, resume: bool) -> list[float]:
    """4 steps of a chain with dropout (or steps 3 and 4 from the checkpoint of step 2); the losses."""
    torch.manual_seed(SEED)
    model = nn.Sequential(*(_Dropped(256) for _ in range(4)))
    pipe = Pipeline(model, Partition.from_bounds((0, 4)), n_microbatches=2, loss_fn=F.mse_loss, mesh=mesh)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(SEED)
    data = [(torch.randn(8, 256, generator=g).cuda(), torch.randn(8, 256, generator=g).cuda()) for _ in range(4)]
    first = 0
    if resume:
        first = checkpoint.load(folder / "step-00000002", pipe, opt).step
    losses = []
    for step in range(first, 4):
        opt.zero_grad()
        losses.append(pipe.step(*data[step]).item())
        opt.step()
        if step == 1 and not resume:
            checkpoint.save(folder, pipe, opt, checkpoint.Progress(step=2, epoch=0, batch=2))
    pipe.close()
    return losses


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 rows in fp32: what the planner and the CPU tests assume
    mesh = init_mesh(1, timeout=600)
    out: dict[str, Any] = {"rows": [row for preset in args.presets for row in check_preset(preset, args, mesh)]}
    with tempfile.TemporaryDirectory() as tmp:
        whole = _dropout_run(mesh, Path(tmp), resume=False)
        resumed = _dropout_run(mesh, Path(tmp), resume=True)
    out["dropout"] = {"whole": whole, "resumed": resumed, "exact": whole[2:] == resumed}
    print(json.dumps({"check": "dropout resumes exactly on the GPU", **out["dropout"]}), flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--presets", type=lambda s: s.split(","), default=["gpt-small", "gpt-medium"])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--peak-flops", type=float, default=989e12)
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("no GPU visible: this check runs on one CUDA device")
        raise SystemExit(1)
    launch(run, 1, args)


if __name__ == "__main__":
    main()
