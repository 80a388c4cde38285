"""What running DualPipeV's forward and backward pairs at once buys expert parallelism: step time with the pairs'
all-to-alls overlapped (``Compute(overlap_all_to_all=True)``) against one action at a time, in the same run.

Gloo processes (one thread each) train an MoE GPT (8 MoE blocks, 8 experts, top 2, one shared expert) under
DualPipeV with ep=2: pp1 x dp2 on 2 processes (both of the V's stages on each rank), then pp2 x dp2 and pp2 x fsdp2
on 4 (more processes than this laptop's 2 cores): two pipelines of the same model on the
same mesh, one per setting, stepped in turn, so that both see the same machine at the same moments. Each rank
also sums the seconds its all-to-alls took (waiting for the peer included). One JSON line per layout: the median
step times, their ratio (overlapped / one at a time), and the all-to-all seconds per step.

    python benchmarks/moe_overlap.py [--steps 12] [--microbatches 8] [--batch 32] [--seq-len 64]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

from stagewise.comm import init_mesh, launch
from stagewise.models.gpt import GPTConfig
from stagewise.models.moe import MoEConfig
from stagewise.partition import Partition
from stagewise.pipeline import Compute, Pipeline, PipelineOptions

CONFIG = GPTConfig(
    vocab_size=256, seq_len=128, d_model=128, n_layers=8, n_heads=4,
    moe=MoEConfig(experts=8, top_k=2, d_expert=256, shared_experts=1),
)  # fmt: skip
BOUNDS = {1: (0, 5, 11), 2: (0, 3, 5, 7, 11)}
"""By pipeline ranks: DualPipeV's two stages per rank over embed, 8 blocks, norm, head; each has MoE blocks."""

EXCHANGE = [0.0]
"""Seconds spent in all-to-alls on this rank since the last reset."""


def _timing_all_to_alls() -> None:
    original = dist.all_to_all_single

    def timed(*args: Any, **kwargs: Any) -> Any:
        began = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            EXCHANGE[0] += time.perf_counter() - began

    dist.all_to_all_single = timed


def rank_times(layouts: list[tuple[int, int, int]], steps: int, m: int, batch: int, seq_len: int) -> list[Any]:
    torch.set_num_threads(1)
    _timing_all_to_alls()
    out = []
    for pp, dp, fsdp in layouts:
        mesh = init_mesh(pp, dp, fsdp=fsdp, ep=2, timeout=120)
        pipes = {}
        for overlap in (False, True):
            torch.manual_seed(0)
            options = PipelineOptions(n_virtual=2, compute=Compute(overlap_all_to_all=overlap))
            pipes[overlap] = Pipeline(
                CONFIG.build(), Partition.from_bounds(BOUNDS[pp]), schedule="dualpipev", n_microbatches=m,
                loss_fn=GPTConfig.loss, mesh=mesh, options=options,
            )  # fmt: skip
        g = torch.Generator().manual_seed(1)
        ids = torch.randint(0, CONFIG.vocab_size, (batch, seq_len), generator=g)[mesh.share(batch)]
        times: dict[bool, list[float]] = {False: [], True: []}
        exchange: dict[bool, list[float]] = {False: [], True: []}
        for step in range(steps + 2):
            for overlap, pipe in pipes.items():
                dist.barrier()
                EXCHANGE[0] = 0.0
                began = time.perf_counter()
                pipe.step(ids, ids)
                if step >= 2:  # two warm-up steps
                    times[overlap].append(time.perf_counter() - began)
                    exchange[overlap].append(EXCHANGE[0])
        for pipe in pipes.values():
            pipe.close()
        out.append({"times": times, "exchange": exchange})
        mesh.close()
    dist.destroy_process_group()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=64)
    ns = parser.parse_args()
    for layouts in ([(1, 2, 1)], [(2, 2, 1), (2, 1, 2)]):
        _report(layouts, ns)


def _report(layouts: list[tuple[int, int, int]], ns: argparse.Namespace) -> None:
    """Launch ``layouts`` (of one world size) and print a line for each."""
    world = layouts[0][0] * layouts[0][1] * layouts[0][2]
    per_rank = launch(rank_times, world, layouts, ns.steps, ns.microbatches, ns.batch, ns.seq_len)
    for i, (pp, dp, fsdp) in enumerate(layouts):
        # The step ends when the slowest rank ends: its time per step, the median over steps.
        step = {
            overlap: statistics.median(
                max(per_rank[r][i]["times"][overlap][s] for r in per_rank) for s in range(ns.steps)
            )
            for overlap in (False, True)
        }
        exchange = {
            overlap: statistics.median(statistics.mean(per_rank[r][i]["exchange"][overlap]) for r in per_rank)
            for overlap in (False, True)
        }
        row = {
            "layout": f"pp{pp} x dp{dp} x fsdp{fsdp} (ep=2)", "schedule": "dualpipev",
            "microbatches": ns.microbatches, "batch": ns.batch, "seq_len": ns.seq_len,
            "step_one_at_a_time_s": round(step[False], 4), "step_overlapped_s": round(step[True], 4),
            "overlapped_over_one_at_a_time": round(step[True] / step[False], 3),
            "all_to_all_s_one_at_a_time": round(exchange[False], 4),
            "all_to_all_s_overlapped": round(exchange[True], 4),
        }  # fmt: skip
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
