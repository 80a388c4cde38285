"""Schedules synthesised for gpt-small's measured stage times against the best built-in, simulated; and how long the
synthesis takes at its largest size.

gpt-small's layers are timed on this CPU (forward and backward, one thread, ``profile(time=True)``), split into
``p`` stages by time (``balance``), and each stage's F and B summed; the profile does not split the backward, so
I = W = B / 2 (a linear layer's input and weight gradients cost the same). The transfer of a boundary's activation is
its bytes at ``--link-bandwidth``. For each p and m, within 1F1B's memory (at most ``p`` micro-batches in flight
per rank), one JSON line: the fastest built-in and the synthesised schedule, their simulated steps and the ratio.
Then the seconds ``synthesise`` takes for p = 16 ranks, 32 stages (the V), m = 64.

    python benchmarks/synthesis.py [--preset gpt-small] [--seq-len 128] [--ranks 2,4] [--microbatches 8,16]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from stagewise.models import preset
from stagewise.partition import balance, profile
from stagewise.schedule import StageCosts, synthesise


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="gpt-small")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--ranks", default="2,4")
    parser.add_argument("--microbatches", default="8,16")
    parser.add_argument("--link-bandwidth", type=float, default=1.5e9, help="bytes per second between ranks")
    ns = parser.parse_args()
    torch.set_num_threads(1)
    config = preset(ns.preset)
    costs = profile(config.build(device="meta"), config.example(1, ns.seq_len), time=True)
    seconds = [c.time or 0.0 for c in costs]
    forward = [c.time * c.forward_flops / c.flops if c.time and c.flops else 0.0 for c in costs]
    for p in (int(x) for x in ns.ranks.split(",")):
        bounds = balance(seconds, p).bounds
        stages = [range(bounds[s], bounds[s + 1]) for s in range(p)]
        f = [sum(forward[i] for i in r) for r in stages]
        b = [sum(seconds[i] for i in r) - fs for r, fs in zip(stages, f, strict=True)]
        transfer = [costs[bounds[s + 1] - 1].output_bytes / ns.link_bandwidth for s in range(p - 1)] or 0.0
        stage_costs = StageCosts.of(p, forward=f, backward=b, transfer=transfer)
        for m in (int(x) for x in ns.microbatches.split(",")):
            found = synthesise(stage_costs, p, m, limit=p)
            print(json.dumps({
                "bench": "synthesis", "preset": ns.preset, "ranks": p, "microbatches": m, "partition": list(bounds),
                "forward_s": [round(x, 4) for x in f], "backward_s": [round(x, 4) for x in b],
                "builtin": found.builtin, "builtin_step_s": round(found.builtin_step_time or 0.0, 4),
                "synthesised": found.schedule.name, "synthesised_step_s": round(found.step_time, 4),
                "speedup": round((found.builtin_step_time or found.step_time) / found.step_time, 4),
            }), flush=True)  # fmt: skip
    began = time.perf_counter()
    largest = synthesise(StageCosts.of(32, forward=1.0, input_grad=1.0, weight_grad=1.0), 16, 64, limit=16)
    print(json.dumps({
        "bench": "synthesis_time", "ranks": 16, "stages": 32, "microbatches": 64, "tried": largest.tried,
        "seconds": round(time.perf_counter() - began, 2), "chosen": largest.schedule.name,
    }), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
