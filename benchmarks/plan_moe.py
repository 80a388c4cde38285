"""The planner on DeepSeek-V3's shape (``gpt-moe-671b``) on 256 GPUs of 80 GiB: 32 nodes of 8 H100-class GPUs.

Costs the model on the meta device as ``stagewise plan`` does, then searches every layout (pp, dp, fsdp, tp, ep,
micro-batches, schedule, memory options) for the fastest that fits, and the fastest at each expert-parallel degree.
Prints one JSON line per search: the layout, its predicted step time and tokens/s, the peak memory of its fullest
rank, the search's seconds; for the best, what its step spends beyond the pipeline and the all-to-alls of one MoE
layer per micro-batch.

    python benchmarks/plan_moe.py [--batch-size 2048] [--expert-imbalance 1.25]

The same search from the command line:

    python -m stagewise plan --model gpt-moe-671b --gpus 256 --gpus-per-node 8 --gpu-memory 80GiB \\
        --gpu-flops 400e12 --gpu-bandwidth 3.35e12 --intra-node-bandwidth 360e9 --network-bandwidth 45e9 \\
        --link-bandwidth 45e9 --batch-size 2048
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from typing import Any

from stagewise.plan import Cluster, Device, Option, Workload, plan
from stagewise.plan.evaluate import overheads
from stagewise.plan.expert_cost import rank_experts
from stagewise.plan.planner import candidates, tensor_parallel_degrees
from stagewise.plan.rejection import Rejection
from stagewise.plan.setting import Settings
from stagewise.plan.time_model import all_to_all_seconds
from stagewise.plan.workload import preset_model, workload

GiB = 2**30
CLUSTER = {
    "gpus": 256,
    "gpus_per_node": 8,
    "memory": 80 * GiB,
    "flops": 400e12,  # sustained, not the datasheet's peak
    "memory_bandwidth": 3.35e12,  # HBM3
    "intra_node_bandwidth": 360e9,  # NVLink 4, what a ring collective gets per GPU
    "network_bandwidth": 45e9,  # 400 Gb/s InfiniBand NDR per GPU, as achieved
    "link_bandwidth": 45e9,  # between adjacent pipeline stages, on different nodes
}
"""32 nodes of 8 H100-class GPUs."""


def cluster() -> Cluster:
    c = CLUSTER
    device = Device(c["memory"], c["flops"], c["memory_bandwidth"])
    return Cluster(
        (device,) * int(c["gpus"]),
        link_bandwidth=c["link_bandwidth"],
        network_bandwidth=c["network_bandwidth"],
        gpus_per_node=int(c["gpus_per_node"]),
        intra_node_bandwidth=c["intra_node_bandwidth"],
    )


def costed(batch_size: int, imbalance: float) -> Workload:
    """gpt-moe-671b costed on the meta device with its loss, one sample of 4096 tokens per profiled micro-batch."""
    model, sample, loss = preset_model("gpt-moe-671b", 1, None)
    work = workload(model, sample, global_batch=batch_size, tokens_per_sample=4096, loss=loss)
    return dataclasses.replace(work, expert_imbalance=imbalance)


def summary(option: Option, work: Workload) -> dict[str, Any]:
    return {
        "layout": option.describe(),
        "ep": option.ep,
        "step_s": round(option.step_time, 3),
        "tokens_per_s": round(option.samples_per_second * work.tokens_per_sample),
        "bubble": round(option.bubble, 3),
        "peak_rank_memory_gib": round(max(option.rank_memory) / GiB, 2),
        "peak_rank_activation_gib": round(max(option.rank_activation) / GiB, 2),
    }


def breakdown(option: Option, work: Workload, where: Cluster) -> dict[str, Any]:
    """What ``option``'s step spends beyond its pipeline, and one MoE layer's all-to-alls per micro-batch."""
    setting = Settings(work, where).of(option)
    assert not isinstance(setting, Rejection) and option.partition is not None
    extra = overheads(setting, option.partition, work, where)
    factor = work.global_batch // option.batch_shards // option.n_microbatches / work.profiled_batch
    every = rank_experts(work.experts, len(work.costs), factor, option.ep, work.expert_imbalance, work.state_multiplier)
    moe = next(e for e in every if e is not None)
    one = all_to_all_seconds(moe.dispatch_bytes, option.ep, option.tp, where)
    return {
        "sync_s": round(extra.sync, 3),
        "optimizer_s": round(extra.optimizer, 3),
        "experts_all_reduce_s": round(extra.experts, 3),
        "all_to_all_bytes_per_moe_layer_and_micro_batch": moe.dispatch_bytes,
        "all_to_alls_s_per_moe_layer_and_micro_batch": round(4 * one, 4),
        "experts_gflop_per_moe_layer_and_micro_batch": round(moe.flops / 1e9, 1),
        "expert_state_gib_per_moe_layer": round(moe.state_bytes / GiB, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=2048, help="samples of 4096 tokens per step")
    parser.add_argument("--expert-imbalance", type=float, default=1.25)
    ns = parser.parse_args()
    began = time.perf_counter()
    work = costed(ns.batch_size, ns.expert_imbalance)
    costing = time.perf_counter() - began
    where = cluster()
    began = time.perf_counter()
    best = plan(work, where, top=8)
    searched = time.perf_counter() - began
    assert best.best is not None, "no layout fits"
    print(
        json.dumps(
            {
                "search": "every layout",
                "batch_size": ns.batch_size,
                "expert_imbalance": ns.expert_imbalance,
                "cluster": CLUSTER,
                **summary(best.best, work),
                "partition": list(best.best.partition.bounds) if best.best.partition else None,
                **breakdown(best.best, work, where),
                "fit": len(best.options),
                "rejected": len(best.rejected),
                "left_out": len(best.unranked),
                "costing_s": round(costing, 1),
                "search_s": round(searched, 1),
            }
        )
    )
    every = candidates(
        where.n_devices, len(work.costs), work.global_batch, tp_degrees=tensor_parallel_degrees(work),
        gpus_per_node=where.gpus_per_node, experts=work.expert_counts,
    )  # fmt: skip
    for ep in sorted({o.ep for o in every}):
        began = time.perf_counter()
        pinned = plan(work, where, options=[o for o in every if o.ep == ep], top=1)
        line: dict[str, Any] = {"search": f"ep={ep}", "search_s": round(time.perf_counter() - began, 1)}
        if pinned.best is not None:
            line.update(summary(pinned.best, work))
        else:
            line["fits"] = False
            line["least_memory_gib"] = (
                None if pinned.smallest_memory is None else round(pinned.smallest_memory / GiB, 2)
            )
        print(json.dumps(line))


if __name__ == "__main__":
    main()
