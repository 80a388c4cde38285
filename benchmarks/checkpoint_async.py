"""How long a checkpoint save stalls training, synchronous against asynchronous (staged in host memory, written in
the background), and how long until the checkpoint is durable (renamed into place with its manifest).

One launch of 2 gloo processes (pp=2) per model trains with AdamW and saves every ``--every`` steps, first
synchronously, then asynchronously, into a folder of its own each (``--dir``, default a temporary one). Per mode,
one JSON line with:

- ``step_s``: the median step without a save in flight (the reference);
- ``stall_s``: the median time the training loop spent in ``save()`` (the step's stall);
- ``slowdown_s``: for the asynchronous save, the extra time per save of the steps that ran while it was in
  flight, over ``step_s`` each (the background write shares the CPU, the disk and the memory bus);
- ``durable_s``: the median time from the call to the checkpoint's rename (for a synchronous save, the stall);
- ``stall_ratio``: ``(stall_s + slowdown_s)`` of the asynchronous save over the synchronous ``stall_s``.

And per model, the seconds to verify its newest checkpoint by the manifest's sizes and by its CRC-32s, against
reading its model entries whole (what a resume reads at least), from the page cache.

    python benchmarks/checkpoint_async.py [--models gpt-small,gpt-medium] [--every 4] [--saves 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from stagewise import checkpoint
from stagewise.comm import init_mesh, launch
from stagewise.models import build
from stagewise.models.gpt import GPTConfig
from stagewise.partition import balance, layers_of
from stagewise.pipeline import Pipeline

BATCH, SEQ, MICROBATCHES = 4, 64, 2


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, 50304, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(0))
    return ids[:, :-1], ids[:, 1:]


def _timed_run(
    pipe: Pipeline, optimizer: torch.optim.Optimizer, saver: checkpoint.Checkpointer, every: int, saves: int
) -> dict[str, list[float]]:
    """Train ``every * saves + 1`` steps, saving after every ``every``-th; each step's time, whether a save was in
    flight during it, each save's stall, and when each save was called and became durable."""
    ids, targets = _batch()
    quiet: list[float] = []
    busy: list[float] = []
    stalls: list[float] = []
    called: list[float] = []
    durable: list[float] = []
    for step in range(1, every * saves + 2):
        pending = saver.in_flight
        in_flight = pending is not None and not pending.done()
        began = time.perf_counter()
        optimizer.zero_grad()
        pipe.step(ids, targets)
        optimizer.step()
        (busy if in_flight else quiet).append(time.perf_counter() - began)
        if step % every or step > every * saves:
            continue
        called.append(time.perf_counter())
        saver.save(optimizer, checkpoint.Progress(step, 0, 0))
        stalls.append(time.perf_counter() - called[-1])
        if saver.in_flight is None:  # synchronous: durable when save() returns
            durable.append(time.perf_counter())
        else:
            saver.in_flight.add_done_callback(lambda _: durable.append(time.perf_counter()))
    saver.close()
    dist.barrier()
    waits = [d - c for c, d in zip(called, durable, strict=True)]
    return {"quiet": quiet, "busy": busy, "stalls": stalls, "durable": waits}


def rank_times(model: str, root: str, every: int, saves: int) -> dict[str, dict[str, list[float]]]:
    torch.set_num_threads(1)
    mesh = init_mesh(pp=2, timeout=600)
    meta = build(model, device="meta")
    sizes = [float(sum(p.numel() for p in layer.module.parameters())) for layer in layers_of(meta)]
    pipe = Pipeline(meta, balance(sizes, 2), n_microbatches=MICROBATCHES, loss_fn=GPTConfig.loss, mesh=mesh)  # type: ignore[arg-type]
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=1e-4)
    out = {}
    for mode in ("sync", "async"):
        saver = checkpoint.Checkpointer(Path(root) / mode, pipe, keep=2, asynchronous=mode == "async")
        out[mode] = _timed_run(pipe, optimizer, saver, every, saves)
    pipe.close()
    dist.destroy_process_group()
    return out


def verification(directory: Path, scratch: Path) -> dict[str, float]:
    """Seconds to verify the newest checkpoint in ``directory`` by sizes and by CRC-32, against reading its model
    entries whole (:func:`checkpoint.export`; a resume reads the optimizer's state too)."""
    newest = checkpoint.latest(directory)
    assert newest is not None
    out = {}
    for name, action in (
        ("verify_sizes_s", lambda: checkpoint.verify(newest, checksums=False)),
        ("verify_checksums_s", lambda: checkpoint.verify(newest, checksums=True)),
        ("read_model_s", lambda: checkpoint.export(newest, scratch / "model.pt")),
    ):
        began = time.perf_counter()
        action()
        out[name] = round(time.perf_counter() - began, 3)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="gpt-small,gpt-medium")
    parser.add_argument("--every", type=int, default=4, help="steps between saves")
    parser.add_argument("--saves", type=int, default=3, help="saves per mode")
    parser.add_argument("--dir", default=None, help="where the checkpoints go (default: a temporary folder)")
    ns = parser.parse_args()
    for model in ns.models.split(","):
        with tempfile.TemporaryDirectory(dir=ns.dir) as root:
            per_rank = launch(rank_times, 2, model, root, ns.every, ns.saves)
            size = sum(f.stat().st_size for f in (Path(root) / "sync").rglob("*") if f.is_file()) / 2  # keep=2
            print(json.dumps({"model": model, **verification(Path(root) / "sync", Path(root))}), flush=True)
        reference: float | None = None
        for mode in ("sync", "async"):
            times = per_rank[0][mode]  # rank 0: it also seals and renames
            step = statistics.median(times["quiet"])
            stall = statistics.median(times["stalls"])
            slowdown = sum(t - step for t in times["busy"]) / ns.saves  # the steps a save in flight slowed
            row = {
                "model": model, "mode": mode, "checkpoint_mb": round(size / 2**20, 1), "step_s": round(step, 3),
                "stall_s": round(stall, 3), "slowdown_s": round(slowdown, 3),
                "durable_s": round(statistics.median(times["durable"]), 3),
            }  # fmt: skip
            if mode == "sync":
                reference = stall
            elif reference:
                row["stall_ratio"] = round((stall + slowdown) / reference, 3)
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
