"""How long a local launch of a short job takes: stagewise.comm.launch with start_method "spawn" vs "forkserver".

Each launch runs a function on ``--ranks`` gloo processes that forms the
process group, all-reduces one number and returns it; the time is from the
call of ``launch`` to its return, in this process. The two start methods
alternate, launch after launch; the fork server is started, with what it
preloads, by the first forkserver launch, which is a warm-up and not timed
(a process that launches many jobs pays it once). ``ratio`` is the median
forkserver launch over the median spawn launch. One JSON line:

    python benchmarks/launch_bench.py [--repeats 8] [--ranks 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist

from stagewise.comm import launch
from stagewise.comm.launch_options import StartMethod


def all_reduce_once() -> int:
    dist.init_process_group("gloo")
    total = torch.tensor([dist.get_rank()])
    dist.all_reduce(total)
    dist.destroy_process_group()
    return int(total)


def timed(method: StartMethod, ranks: int) -> float:
    start = time.perf_counter()
    results = launch(all_reduce_once, ranks, start_method=method)
    elapsed = time.perf_counter() - start
    expected = ranks * (ranks - 1) // 2
    if results != dict.fromkeys(range(ranks), expected):
        raise RuntimeError(f"the job returned {results}, not {expected} on every rank")
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=8, help="timed launches per start method")
    parser.add_argument("--ranks", type=int, default=2, help="processes per launch")
    ns = parser.parse_args()
    timed("forkserver", ns.ranks)  # starts the fork server
    times: dict[StartMethod, list[float]] = {"spawn": [], "forkserver": []}
    for _ in range(ns.repeats):
        for method in ("spawn", "forkserver"):
            times[method].append(timed(method, ns.ranks))
    spawn, fork = statistics.median(times["spawn"]), statistics.median(times["forkserver"])
    row = {
        "ranks": ns.ranks,
        "repeats": ns.repeats,
        "spawn_s": round(spawn, 3),
        "forkserver_s": round(fork, 3),
        "ratio": round(fork / spawn, 3),
    }
    print(json.dumps(row))


if __name__ == "__main__":
    main()
