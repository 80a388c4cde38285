"""Pipeline step time on 2 gloo processes: stagewise vs torch.distributed.pipelining vs one process.

On identical stages and data (residual-MLP blocks of width d, L blocks,
batch B, m micro-batches, one thread per process), in one run:

- single process, full batch, and single process, micro-batched (gradient
  accumulation), the latter with autograd's accumulation, with stagewise's
  fused weight-gradient accumulation, and with it pooled into one GEMM per
  weight every 2 micro-batches and over the whole step (as stagewise's GPipe
  does);
- stagewise.Pipeline with gpipe and 1f1b (the default fusion, which pools
  what fits in the pipeline's peak in flight, ``pool="free"``; and autograd's
  accumulation), 1f1b fusing each backward without pooling (``pool=1``) and
  pooling every 2 backwards, and zero-bubble (fused);
- torch.distributed.pipelining's ScheduleGPipe and Schedule1F1B on the same two stages;
- both ranks computing their own stage's forwards and backwards (autograd's
  accumulation) at the same time, with no transfers: on a machine whose
  cores share caches and memory bandwidth, the compute a pipeline step cannot
  go below. With the bubble, ``floor`` = that time x (m + p - 1) / m.

Efficiency is the micro-batched single-process step time (autograd's
accumulation) over p times the pipeline's step time (ideal m / (m + p - 1) =
0.889 for m=8, p=2); same-compute efficiency divides the single-process time
with the same accumulation as the variant instead. Peak activation memory is
the largest total of tensors that stage 0 holds at once for backward: saved
by autograd, or kept for a pooled weight gradient; the same for stage 1. One JSON line per (d, variant):

    python benchmarks/pipeline_bench.py [--widths 256,1024] [--steps 6] [--block 4] [--pin-cores]
                                        [--cut 3 --synthesise]

``--cut K`` puts blocks ``0..K-1`` on stage 0 (unequal stages); ``--synthesise`` also runs the schedule
:func:`~stagewise.schedule.synthesise` builds for the two stages' times measured on the ranks (their forward
backward, and backward split into I and W, on one micro-batch), within 1F1B's memory, and prints its step against
the fastest of stagewise's built-in variants in the same run.

Each variant runs ``block`` consecutive steps at a time, as training runs them, the first of each block not timed
(it follows another variant's and warms the caches); blocks go round-robin over the variants, in a rotating order,
until each has ``steps`` timed steps; the figures are medians. ``--block 1`` is the plain round-robin of one step.

With ``--pin-cores`` each rank, and every thread it starts, runs on a core of its own (``launch(..., pin_cores=True)``):
every variant runs in the same two pinned processes.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import statistics
import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from stagewise.comm import init_mesh, launch
from stagewise.partition import Partition
from stagewise.pipeline import Pipeline, PipelineOptions, WeightGradientFusion
from stagewise.pipeline.backward.fusion import FusedWeightGradients, WeightGradientStore
from stagewise.schedule import StageCosts, synthesise
from stagewise.schedule.synthesis import Synthesis


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = x + self.down(F.gelu(self.up(self.norm(x))))
        return out


def model(d: int, n_layers: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(Block(d) for _ in range(n_layers)))


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


@contextmanager
def saved_bytes(params: Callable[[], Iterable[nn.Parameter]]) -> Iterator[list[int]]:
    """Track the peak bytes kept for backward (the parameters excluded): saved by autograd or for pooled gradients.

    ``params()`` is asked at the first tensor saved, so that it names the parameters the layers read then (FSDP's
    whole ones during a step); a sharded tensor counts by its local shard.
    """
    weights: set[int] = set()
    state = [0, 0]  # live, peak
    live: dict[int, int] = {}

    def drop(key: int, size: int) -> None:
        live[key] -= 1
        if not live[key]:
            del live[key]
            state[0] -= size

    def pack(t: torch.Tensor) -> torch.Tensor:
        if not weights:
            weights.update(_local(p).untyped_storage().data_ptr() for p in params())
        storage = _local(t).untyped_storage()
        key, size = storage.data_ptr(), storage.nbytes()
        if key in weights:
            return t
        if key not in live:
            live[key] = 0
            state[0] += size
            state[1] = max(state[1], state[0])
        live[key] += 1
        weakref.finalize(t, drop, key, size)
        return t

    add = WeightGradientStore.add
    counted: dict[int, weakref.ref[torch.Tensor]] = {}  # by id; a tensor's == compares values

    def pool(store: WeightGradientStore, *args: Any) -> None:
        add(store, *args)
        for t in store.tensors():
            known = counted.get(id(t))
            if known is None or known() is not t:
                counted[id(t)] = weakref.ref(t)
                pack(t)

    peak = [0]
    WeightGradientStore.add = pool  # type: ignore[method-assign]
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield peak
    finally:
        WeightGradientStore.add = add  # type: ignore[method-assign]
    peak[0] = state[1]


def _single(full: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
    full.zero_grad()
    F.mse_loss(full(x), y).backward()


def _accumulated(full: nn.Module, x: torch.Tensor, y: torch.Tensor, m: int, pool: int | None = 0) -> None:
    """Gradient accumulation over m micro-batches as Pipeline's default fusion does it, pooling every ``pool``.

    ``pool`` 0: by autograd; 1: fused; None: pooled over the whole step.
    """
    full.zero_grad()
    fusion = WeightGradientFusion()
    least = fusion.threshold(pooled=pool != 1)
    large = [p for p in full.parameters() if p.numel() >= least] if pool != 0 else []
    store = WeightGradientStore() if pool != 1 else None
    own = frozenset(id(p) for p in full.parameters())  # the biases a fused op may take, as a stage's
    for i, (xs, ys) in enumerate(zip(x.tensor_split(m), y.tensor_split(m), strict=True)):
        if large:
            with FusedWeightGradients(large, store=store, own=own):
                out = full(xs)
        else:
            out = full(xs)
        (F.mse_loss(out, ys) / m).backward()
        if store is not None and pool and (i + 1) % pool == 0:
            store.flush()
    if store is not None:
        store.flush()


def _own_stage(mine: nn.Module, x: torch.Tensor, m: int) -> None:
    """This rank's stage, forward and backward over m micro-batches, alone: no transfers, no waiting."""
    mine.zero_grad()
    for xs in x.tensor_split(m):
        out = mine(xs.detach().requires_grad_())
        out.backward(torch.ones_like(out))


def _stagewise_step(pipe: Pipeline, x: torch.Tensor, y: torch.Tensor) -> None:
    for p in pipe.parameters():
        p.grad = None
    pipe.step(x, y)


def _torch_step(sched: Any, mine: nn.Module, rank: int, x: torch.Tensor, y: torch.Tensor) -> None:
    mine.zero_grad(set_to_none=True)
    if rank == 0:
        sched.step(x)
    else:
        sched.step(target=y, losses=[])


UNFUSED = " (autograd accumulation)"
POOLED = ", pool 2"
UNPOOLED = ", no pool"
VARIANTS: dict[str, WeightGradientFusion] = {
    "gpipe": WeightGradientFusion(),
    "1f1b": WeightGradientFusion(),
    f"1f1b{UNPOOLED}": WeightGradientFusion(pool=1),
    f"1f1b{POOLED}": WeightGradientFusion(pool=2),
    "zero-bubble": WeightGradientFusion(),
    f"gpipe{UNFUSED}": WeightGradientFusion.off(),
    f"1f1b{UNFUSED}": WeightGradientFusion.off(),
}
"""stagewise's variants and their weight-gradient accumulation: the default (``pool="free"``: GPipe pools the whole
step, 1F1B on stage 1 pools 2 backwards, what fits in stage 0's peak, zero-bubble's W adds each micro-batch's), 1F1B
fusing each backward with no pool and pooling every 2 backwards on both stages, and autograd's."""


def _schedule_of(variant: str) -> str:
    """The schedule a variant runs: its name without the accumulation it uses."""
    return variant.removesuffix(UNFUSED).removesuffix(POOLED).removesuffix(UNPOOLED)


SINGLES: dict[str, int | None] = {
    "single_microbatched": 0,
    "single_microbatched_fused": 1,
    "single_microbatched_pooled_2": 2,
    "single_microbatched_pooled": None,
}
"""The single-process micro-batched references, by how they pool (see ``_accumulated``)."""
SAME_COMPUTE = {
    "gpipe": "single_microbatched_pooled",
    "1f1b": "single_microbatched_fused",
    f"1f1b{UNPOOLED}": "single_microbatched_fused",
    f"1f1b{POOLED}": "single_microbatched_pooled_2",
    "zero-bubble": "single_microbatched_fused",
}
"""The single-process reference that accumulates weight gradients as each variant does, for same-compute efficiency."""


@dataclass(frozen=True)
class Timing:
    """How many steps are timed per variant, and in blocks of how many consecutive steps (the first untimed)."""

    steps: int
    block: int


def _stage_costs(own: nn.Module, x: torch.Tensor, m: int) -> tuple[float, ...]:
    """Median seconds (of 7) of this rank's stage on one micro-batch: its forward, its whole backward, and its
    backward split into the input's gradient (I) and then the parameters' (W), as autograd runs them."""
    xs = x.tensor_split(m)[0]
    params = [p for p in own.parameters() if p.requires_grad]
    samples: list[list[float]] = [[], [], [], []]
    for _ in range(7):
        marks = [time.perf_counter()]
        inputs = xs.detach().requires_grad_()
        out = own(inputs)
        marks.append(time.perf_counter())
        out.backward(torch.ones_like(out))
        marks.append(time.perf_counter())
        out = own(inputs)
        began = time.perf_counter()
        torch.autograd.grad(out, [inputs], torch.ones_like(out), retain_graph=True)
        marks += [began, time.perf_counter()]
        torch.autograd.grad(out, params, torch.ones_like(out))
        marks.append(time.perf_counter())
        for k, (a, b) in enumerate([(0, 1), (1, 2), (3, 4), (4, 5)]):
            samples[k].append(marks[b] - marks[a])
    return tuple(statistics.median(s) for s in samples)


def _synthesised(own: nn.Module, x: torch.Tensor, m: int) -> Synthesis:
    """The schedule synthesised for the stages' measured times (their forward, backward, I and W on one
    micro-batch; transfers not counted) within 1F1B's memory (2 micro-batches in flight a rank)."""
    mine = _stage_costs(own, x, m)
    both: list[tuple[float, ...]] = [(), ()]
    dist.all_gather_object(both, mine)
    f, b, i, w = ([stage[k] for stage in both] for k in range(4))
    costs = StageCosts.of(
        2, forward=f, backward=b, input_grad=i, weight_grad=[max(y, z - x) for x, y, z in zip(i, w, b, strict=True)]
    )
    return synthesise(costs, 2, m, limit=2)


@dataclass(frozen=True)
class Shape:
    """The benchmark's model, batch and split: the widths tried, the blocks, the batch, its micro-batches, where
    the blocks split into the two stages (None: half each) and whether a synthesised schedule runs too."""

    widths: list[int]
    n_layers: int
    batch: int
    microbatches: int
    cut: int | None = None
    synthesise: bool = False


def worker(shape: Shape, timing: Timing) -> list[dict[str, object]]:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    torch.set_num_threads(1)
    mesh = init_mesh(2, timeout=600)
    rank = mesh.rank
    rows: list[dict[str, object]] = []
    n_layers, batch, m = shape.n_layers, shape.batch, shape.microbatches
    for d in shape.widths:
        g = torch.Generator().manual_seed(1)
        x, y = torch.randn(batch, d, generator=g), torch.randn(batch, d, generator=g)
        variants: dict[str, Callable[[], object]] = {}
        full = model(d, n_layers)
        idle = functools.partial(lambda: None)
        # The single-process references run on rank 0 alone while rank 1 waits.
        variants["single_full_batch"] = functools.partial(_single, full, x, y) if rank == 0 else idle
        for single, pool in SINGLES.items():
            variants[single] = functools.partial(_accumulated, full, x, y, m, pool) if rank == 0 else idle
        half = (0, n_layers // 2 if shape.cut is None else shape.cut, n_layers)
        pipes = {}
        for name, fusion in VARIANTS.items():
            schedule = _schedule_of(name)
            pipes[name] = Pipeline(
                model(d, n_layers), Partition.from_bounds(half), schedule=schedule, n_microbatches=m,  # type: ignore[arg-type]
                loss_fn=F.mse_loss, mesh=mesh, options=PipelineOptions(fuse_weight_gradients=fusion),
            )  # fmt: skip
            variants[f"stagewise_{name}"] = functools.partial(_stagewise_step, pipes[name], x, y)
        mine = nn.Sequential(*list(model(d, n_layers))[half[rank] : half[rank + 1]])
        for name, cls in (("torch_gpipe", ScheduleGPipe), ("torch_1f1b", Schedule1F1B)):
            sched = cls(PipelineStage(mine, rank, 2, torch.device("cpu")), m, loss_fn=F.mse_loss)
            variants[name] = functools.partial(_torch_step, sched, mine, rank, x, y)
        own = nn.Sequential(*list(model(d, n_layers))[half[rank] : half[rank + 1]])
        variants["concurrent_stages"] = functools.partial(_own_stage, own, x, m)
        found = _synthesised(own, x, m) if shape.synthesise else None
        if found is not None:
            pipes["synthesised"] = Pipeline(
                model(d, n_layers), Partition.from_bounds(half), schedule=found.schedule, n_microbatches=m,
                loss_fn=F.mse_loss, mesh=mesh,
            )  # fmt: skip
            variants["stagewise_synthesised"] = functools.partial(_stagewise_step, pipes["synthesised"], x, y)
        for fn in variants.values():  # warm-up, and torch's shape inference
            fn()
            fn()
        # Blocks of consecutive steps, as training runs them, round-robin over the variants in a rotating order so
        # the machine's drift touches them all alike; a block's first step, which follows another variant's, warms
        # its caches and is not counted.
        samples: dict[str, list[float]] = {name: [] for name in variants}
        names = list(variants)
        steps, block = timing.steps, timing.block
        rounds = -(-steps // (block - 1)) if block > 1 else steps
        for turn in range(rounds):
            for name in names[turn % len(names) :] + names[: turn % len(names)]:
                for k in range(block):
                    dist.barrier()
                    start = time.perf_counter()
                    variants[name]()
                    if k or block == 1:
                        samples[name].append(time.perf_counter() - start)
        memory = {}
        for schedule, pipe in pipes.items():
            with saved_bytes(pipe.parameters) as peak:
                _stagewise_step(pipe, x, y)
            memory[f"stagewise_{schedule}"] = peak[0]
        times = {name: statistics.median(v) for name, v in samples.items()}
        row = {"d": d, "rank": rank, "times": times, "stage_peak_saved_bytes": memory, "bounds": half}
        if found is not None:
            builtin_step = found.builtin_step_time if found.builtin_step_time is not None else math.nan
            row["synthesis"] = {"builtin": found.builtin, "simulated_speedup": builtin_step / found.step_time,
                                "tried": found.tried, "schedule": found.schedule.to_text()}  # fmt: skip
        rows.append(row)
    dist.destroy_process_group()
    return rows


def _print_synthesised(d: int, row: dict[str, Any], both: dict[str, float]) -> None:
    """The synthesised schedule's step against the fastest built-in variant of stagewise's in the same run."""
    builtins = {name: both[f"stagewise_{name}"] for name in VARIANTS}
    best = min(builtins, key=builtins.__getitem__)
    synthesis = row["synthesis"]
    print(json.dumps({
        "d": d, "variant": "stagewise synthesised", "bounds": row["bounds"],
        "step_ms": round(both["stagewise_synthesised"] * 1e3, 2),
        "best_builtin": best, "best_builtin_ms": round(builtins[best] * 1e3, 2),
        "speedup_vs_best_builtin": round(builtins[best] / both["stagewise_synthesised"], 3),
        "simulated_builtin": synthesis["builtin"], "simulated_speedup": round(synthesis["simulated_speedup"], 3),
        "schedule": synthesis["schedule"],
    }), flush=True)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--widths", default="256,1024")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--steps", type=int, default=6, help="timed steps per variant (at least)")
    parser.add_argument(
        "--block", type=int, default=4, help="consecutive steps of a variant at a time, the first not timed; 1: none"
    )
    parser.add_argument(
        "--pin-cores",
        action="store_true",
        help="give each rank a core of its own (launch's pin_cores), for all variants",
    )
    parser.add_argument("--cut", type=int, help="the first block of stage 1 (default: half the blocks)")
    parser.add_argument(
        "--synthesise", action="store_true",
        help="also run a schedule synthesised for the stages' measured times, within 1F1B's memory",
    )  # fmt: skip
    args = parser.parse_args()
    widths = [int(w) for w in args.widths.split(",")]
    shape = Shape(widths, args.layers, args.batch, args.microbatches, args.cut, args.synthesise)
    out = launch(worker, 2, shape, Timing(args.steps, args.block), pin_cores=args.pin_cores)
    p, m = 2, args.microbatches
    for i, d in enumerate(widths):
        r0, r1 = out[0][i], out[1][i]
        t0: dict[str, float] = r0["times"]  # type: ignore[assignment]
        t1: dict[str, float] = r1["times"]  # type: ignore[assignment]
        both = {k: max(t0[k], t1[k]) for k in t0}  # a pipeline step ends when both ranks are done
        for single in ("single_full_batch", *SINGLES):
            both[single] = t0[single]
        ref = both["single_microbatched"]
        for variant in VARIANTS:
            ours = both[f"stagewise_{variant}"]
            same = both[SAME_COMPUTE.get(variant, "single_microbatched")]
            row: dict[str, object] = {
                "d": d,
                "variant": f"stagewise {variant}",
                "step_ms": round(ours * 1e3, 2),
                "efficiency": round(ref / (p * ours), 3),
                "same_compute_efficiency": round(same / (p * ours), 3),
                "ideal": round(m / (m + p - 1), 3),
                "stage0_peak_saved_mib": round(r0["stage_peak_saved_bytes"][f"stagewise_{variant}"] / 2**20, 2),  # type: ignore[index]
                "stage1_peak_saved_mib": round(r1["stage_peak_saved_bytes"][f"stagewise_{variant}"] / 2**20, 2),  # type: ignore[index]
            }
            torch_name = {"gpipe": "torch_gpipe", "1f1b": "torch_1f1b"}.get(_schedule_of(variant))
            if torch_name:
                row["torch_step_ms"] = round(both[torch_name] * 1e3, 2)
                row["torch_efficiency"] = round(ref / (p * both[torch_name]), 3)
                row["ratio_vs_torch"] = round(ours / both[torch_name], 3)
            print(json.dumps(row), flush=True)
        print(
            json.dumps(
                {
                    "d": d,
                    "variant": "single process",
                    "full_batch_ms": round(both["single_full_batch"] * 1e3, 2),
                    "microbatched_ms": round(ref * 1e3, 2),
                    "microbatched_fused_ms": round(both["single_microbatched_fused"] * 1e3, 2),
                    "microbatched_pooled_2_ms": round(both["single_microbatched_pooled_2"] * 1e3, 2),
                    "microbatched_pooled_ms": round(both["single_microbatched_pooled"] * 1e3, 2),
                }
            ),
            flush=True,
        )
        if args.synthesise:
            _print_synthesised(d, r0, both)
        concurrent = both["concurrent_stages"]
        floor = concurrent * (m + p - 1) / m
        print(
            json.dumps(
                {
                    "d": d,
                    "variant": "both stages at once, without transfers",
                    "step_ms": round(concurrent * 1e3, 2),
                    "floor_ms": round(floor * 1e3, 2),
                    "torch_gpipe_over_floor": round(both["torch_gpipe"] / floor, 3),
                    "torch_1f1b_over_floor": round(both["torch_1f1b"] / floor, 3),
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
