"""Round trips of activation-sized tensors between 2 gloo processes: stagewise's Transport vs raw send/recv.

For each size, rank 0 sends a float32 tensor to rank 1, which sends it back;
the round trip of stagewise.comm.Transport (metadata, batched non-blocking
ops, reused receive buffers, on a dedicated group as Pipeline uses it: through
shared memory, as both ranks share a host) is compared with dist.send/dist.recv
of the same tensors into preallocated buffers, and with the same Transport
kept on gloo (``shared_memory=False``). The variants are timed in blocks in the same processes, in an
order that rotates; ``ratio`` is the median over repeats of ours / raw of the
same repeat, which cancels most of the drift of a shared machine. One
JSON line per size. ``pipeline_*`` is the round trip as the pipeline makes it:
the activation with its metadata protocol, the gradient back without
metadata (the receiver knows its layout).


    python benchmarks/p2p_bench.py [--repeats 60] [--sizes-kib 8,64,256,1024,4096,16384,65536]
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time

import torch
import torch.distributed as dist

from stagewise.comm import Transport, init_mesh, launch
from stagewise.comm.meta import TensorMeta


def _raw_round_trip(t: torch.Tensor, buf: torch.Tensor, rank: int) -> None:
    if rank == 0:
        dist.send(t, 1)
        dist.recv(buf, 1)
    else:
        dist.recv(buf, 0)
        dist.send(buf, 0)


def _ours_round_trip(transport: Transport, t: torch.Tensor, rank: int) -> None:
    if rank == 0:
        transport.send(t, 1, what="activation")
        back = transport.recv(1, what="gradient")
        transport.release(back)
    else:
        got = transport.recv(0, what="activation")
        transport.send(got, 0, what="gradient")
        transport.wait_sends()
        transport.release(got)
    transport.wait_sends()


def _pipeline_round_trip(transport: Transport, t: torch.Tensor, rank: int) -> None:
    """As the pipeline does it: the activation with its metadata protocol, the gradient with a known layout."""
    layout = (False, (TensorMeta(t.dtype, tuple(t.shape), False),))
    if rank == 0:
        transport.send(t, 1, what="activation", stream=2)
        back = transport.irecv(1, what="gradient", stream=3, expect=layout).wait()
        transport.release(back)
    else:
        got = transport.recv(0, what="activation", stream=2)
        transport.send(got, 0, what="gradient", stream=3, known=True)
        transport.wait_sends()
        transport.release(got)
    transport.wait_sends()


def worker(sizes_kib: list[int], repeats: int, block: int) -> list[dict[str, float]]:
    torch.set_num_threads(1)
    mesh = init_mesh(2, timeout=120)
    rank = mesh.rank
    # Dedicated, as Pipeline makes it; streams 0 and 1 for the plain round trip, 2 and 3 for the pipeline-style one.
    transport = Transport(timeout=120.0, dedicated=True, streams=4)
    over_gloo = Transport(timeout=120.0, dedicated=True, streams=4, shared_memory=False)
    rows = []
    for kib in sizes_kib:
        t = torch.randn(kib * 1024 // 4)
        buf = torch.empty_like(t)
        raw: list[float] = []
        ours: list[float] = []
        piped: list[float] = []
        gloo: list[float] = []
        ratios: list[float] = []
        piped_ratios: list[float] = []
        gloo_ratios: list[float] = []
        for _ in range(3):  # warm-up both paths
            _raw_round_trip(t, buf, rank)
            _ours_round_trip(transport, t, rank)
            _pipeline_round_trip(transport, t, rank)
            _pipeline_round_trip(over_gloo, t, rank)
        variants = [
            (functools.partial(_raw_round_trip, t, buf, rank), raw),
            (functools.partial(_ours_round_trip, transport, t, rank), ours),
            (functools.partial(_pipeline_round_trip, transport, t, rank), piped),
            (functools.partial(_pipeline_round_trip, over_gloo, t, rank), gloo),
        ]
        for repeat in range(repeats):
            # Rotate which variant runs first after the barrier, so no variant always pays for it.
            turn = repeat % len(variants)
            for fn, out in variants[turn:] + variants[:turn]:
                dist.barrier()
                start = time.perf_counter()
                for _ in range(block):
                    fn()
                out.append((time.perf_counter() - start) / block)
            ratios.append(ours[-1] / raw[-1])
            piped_ratios.append(piped[-1] / raw[-1])
            gloo_ratios.append(gloo[-1] / raw[-1])
        rows.append(
            {
                "bytes": kib * 1024,
                "raw_ms": statistics.median(raw) * 1e3,
                "stagewise_ms": statistics.median(ours) * 1e3,
                "paired_ratio": statistics.median(ratios),
                "pipeline_ms": statistics.median(piped) * 1e3,
                "pipeline_ratio": statistics.median(piped_ratios),
                "gloo_pipeline_ms": statistics.median(gloo) * 1e3,
                "gloo_pipeline_ratio": statistics.median(gloo_ratios),
            }
        )
    transport.close()
    over_gloo.close()
    dist.destroy_process_group()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=60)
    parser.add_argument("--block", type=int, default=10, help="round trips per timed block")
    parser.add_argument("--sizes-kib", default="8,64,256,1024,4096,16384,65536")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes_kib.split(",")]
    rows = launch(worker, 2, sizes, args.repeats, args.block)[0]
    for row in rows:
        ratio = row["paired_ratio"]
        print(
            json.dumps(
                {
                    "bench": "p2p_round_trip",
                    "bytes": row["bytes"],
                    "raw_ms": round(row["raw_ms"], 4),
                    "stagewise_ms": round(row["stagewise_ms"], 4),
                    "ratio": round(ratio, 3),
                    "overhead_pct": round(100 * (ratio - 1), 1),
                    "pipeline_ms": round(row["pipeline_ms"], 4),
                    "pipeline_ratio": round(row["pipeline_ratio"], 3),
                    "gloo_pipeline_ms": round(row["gloo_pipeline_ms"], 4),
                    "gloo_pipeline_ratio": round(row["gloo_pipeline_ratio"], 3),
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
