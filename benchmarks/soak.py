"""Soak: 1000 training steps of the tiny preset on 2 processes; does memory or the thread count grow?

Each rank reads its resident set size (``VmRSS`` in /proc/self/status) and
its thread count (Python threads, and all native threads in
/proc/self/task) after the warm-up steps and after the last step. One JSON
line per rank; ``rss_growth`` is end over start, minus one.

    python benchmarks/soak.py [--steps 1000] [--warmup 50]
"""

from __future__ import annotations

import argparse
import json
import os
import threading
from typing import Any

import torch

from stagewise.comm import launch
from stagewise.run import TrainConfig, train


def rss_bytes() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def sample() -> dict[str, int]:
    native = len(os.listdir("/proc/self/task"))
    return {"rss": rss_bytes(), "threads": threading.active_count(), "native_threads": native}


def soak(config: TrainConfig, warmup: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    marks: dict[str, dict[str, int]] = {}

    def stepped(step: int, loss: float, seconds: float) -> None:
        if step == warmup:
            marks["start"] = sample()

    summary = train(config, on_step=stepped)
    marks["end"] = sample()
    return {"marks": marks, "first_loss": summary.losses[0], "last_loss": summary.losses[-1]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--warmup", type=int, default=50)
    ns = parser.parse_args()
    config = TrainConfig(
        model="gpt-tiny", pp=2, microbatches=4, batch_size=16, seq_len=64, steps=ns.steps, eval_every=0
    )
    for rank, got in sorted(launch(soak, 2, config, ns.warmup).items()):
        start, end = got["marks"]["start"], got["marks"]["end"]
        row = {
            "bench": "soak",
            "rank": rank,
            "steps": ns.steps,
            "rss_start_mib": round(start["rss"] / 2**20, 1),
            "rss_end_mib": round(end["rss"] / 2**20, 1),
            "rss_growth": round(end["rss"] / start["rss"] - 1, 4),
            "threads_start": start["threads"],
            "threads_end": end["threads"],
            "native_threads_start": start["native_threads"],
            "native_threads_end": end["native_threads"],
            "loss": [round(got["first_loss"], 3), round(got["last_loss"], 3)],
        }
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
