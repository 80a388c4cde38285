"""The planner's search for gpt-70b on 64 GPUs: every layout evaluated, against the search for the 8 fastest.

Both must give the same 8 fastest layouts with the same figures (checked here). Times are medians of ``--repeats``
runs of ``plan()`` on one workload, costed once as ``stagewise plan`` costs it before it searches, each run with no
schedule built yet, as in a fresh process; with
``--command``, also of the whole command (Python's start, the imports, the costing, the search, the printing).
One JSON line per search.

    python benchmarks/plan_search.py [--repeats 3] [--command]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

from stagewise.models import preset
from stagewise.plan import Cluster, Device, Plan, Workload, plan, workload
from stagewise.plan.setting import clear_caches

COMMAND = [
    sys.executable, "-m", "stagewise", "plan", "--model", "gpt-70b", "--gpus", "64", "--gpu-memory", "80GiB",
    "--gpu-flops", "400e12", "--batch-size", "512", "--seq-len", "4096",
]  # fmt: skip
TOP = 8
"""What ``stagewise plan`` shows (its ``--top``)."""


def seventy() -> tuple[Workload, Cluster]:
    """gpt-70b, 512 samples of 4096 tokens per step, costed on the meta device with its loss; 64 x 80 GiB."""
    config = preset("gpt-70b")
    model, sample = config.build(device="meta"), config.example(1, 4096)
    loss = (config.loss, config.target(1, 4096))
    work = workload(model, sample, global_batch=512, tokens_per_sample=4096, loss=loss)  # type: ignore[arg-type]
    return work, Cluster((Device(80 * 2**30, 400e12),) * 64)


def timed(search: str, work: Workload, cluster: Cluster, top: int | None, repeats: int) -> Plan:
    """Run the search ``repeats`` times and print its median seconds and what it found; the last plan."""
    samples = []
    for _ in range(repeats):
        clear_caches()  # as the command starts: no schedule built yet
        began = time.perf_counter()
        result = plan(work, cluster, top=top)
        samples.append(time.perf_counter() - began)
    best = result.options[0]
    print(
        json.dumps(
            {
                "search": search,
                "seconds": round(statistics.median(samples), 2),
                "samples": [round(s, 2) for s in samples],
                "fit": len(result.options),
                "rejected": len(result.rejected),
                "left_out": len(result.unranked),
                "best": best.describe(),
                "step_time": round(best.step_time, 2),
                "tokens_per_second": round(best.samples_per_second * work.tokens_per_sample),
            }
        ),
        flush=True,
    )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--command", action="store_true", help="also time the whole `stagewise plan` command")
    args = parser.parse_args()
    work, cluster = seventy()
    whole = timed("every layout", work, cluster, None, args.repeats)
    top = timed(f"the {TOP} fastest", work, cluster, TOP, args.repeats)
    if top.options != whole.options[:TOP]:
        raise SystemExit(f"the search for the {TOP} fastest found other layouts or figures than the whole search")
    if args.command:
        samples = []
        for _ in range(args.repeats):
            began = time.perf_counter()
            subprocess.run(COMMAND, check=True, capture_output=True)
            samples.append(time.perf_counter() - began)
        line = {"command": " ".join(["stagewise", *COMMAND[3:]]), "seconds": round(statistics.median(samples), 2)}
        print(json.dumps({**line, "samples": [round(s, 2) for s in samples]}), flush=True)


if __name__ == "__main__":
    main()
