"""Time and quality of balance() on 1e3..1e6 layers and 4..64 stages; one JSON line per configuration.

quality = bottleneck / lower bound, where the lower bound is max(max w, sum w / k):
no split can beat it, and the exact optimum is usually within a hair of it.
Time is the median of several runs, and is also given as a ratio to one
np.cumsum over the same weights (the cost of reading the input once), which
drifts with the machine in the same way.

    python benchmarks/partition_bench.py [--repeats 5] [--sizes 1000,10000,100000,1000000]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch

from stagewise.partition import MemoryModel, balance


def median_seconds(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--sizes", default="1000,10000,100000,1000000")
    parser.add_argument("--stages", default="4,16,64")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    sizes = [int(s) for s in args.sizes.split(",")]
    stages = [int(s) for s in args.stages.split(",")]
    for dist in ("uniform", "lognormal"):
        for n in sizes:
            w = rng.random(n) if dist == "uniform" else rng.lognormal(0.0, 1.0, n)
            cumsum = median_seconds(lambda w=w: np.cumsum(w), args.repeats)
            for k in stages:
                seconds = median_seconds(lambda w=w, k=k: balance(w, k), args.repeats)
                part = balance(w, k)
                bound = max(float(w.max()), float(w.sum()) / k)
                print(
                    json.dumps(
                        {
                            "case": "weights",
                            "weights": dist,
                            "n_layers": n,
                            "n_stages": k,
                            "balance_ms": round(seconds * 1e3, 3),
                            "cumsum_ms": round(cumsum * 1e3, 3),
                            "ratio_to_cumsum": round(seconds / cumsum, 1),
                            "quality": round(part.bottleneck / bound, 6),
                        }
                    ),
                    flush=True,
                )
    # Mixed devices and a 1F1B memory model under capacities, at the target size.
    n, k = 100_000, 64
    w = rng.random(n)
    speeds = rng.choice([1.0, 2.0], size=k)
    model = MemoryModel(
        fixed=tuple(rng.random(n).tolist()), activation=tuple(rng.random(n).tolist()), in_flight=tuple(range(k, 0, -1))
    )
    free = balance(w, k, speeds=speeds, memory=model)
    assert free.memory is not None
    caps = [0.97 * max(free.memory)] * k  # tight enough to move boundaries
    seconds = median_seconds(lambda: balance(w, k, speeds=speeds, memory=model, capacities=caps), args.repeats)
    part = balance(w, k, speeds=speeds, memory=model, capacities=caps)
    bound = max(float(w.max()) / speeds.max(), float(w.sum()) / float(speeds.sum()))
    print(
        json.dumps(
            {
                "case": "speeds+1f1b-memory+capacities",
                "n_layers": n,
                "n_stages": k,
                "balance_ms": round(seconds * 1e3, 3),
                "quality": round(part.bottleneck / bound, 6),
                "memory_bound_active": part.bottleneck > free.bottleneck,
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
