"""Each rank's training state under pipeline x FSDP x tensor parallelism, against the unsplit model's.

One launch of 4 gloo processes trains gpt-small (tied embedding and head) one AdamW step in each layout, and
each rank sums the bytes of the tensors it holds for training between steps: its parameters, their gradients and
the optimizer's state (a sharded tensor counts by its local shard; each storage once). The unsplit model takes
the same step in this process. One JSON line per layout: every rank's bytes, the largest over the unsplit
model's, the target ``1 / (pp x fsdp x tp)``, and their ratio.

With ``pp > 1`` the tied embedding and head are both held, one copy on each end stage (the model has one), so
those layouts also report the largest rank's share of the model's parameters as split (``split_share``): the
target over the stages as they are.

    python benchmarks/shard_memory.py [--model gpt-small] [--layouts 1x1x4x1,1x1x2x2,2x1x2x1,2x1x1x2,...]
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from stagewise.comm import PipelineMesh, init_mesh, launch
from stagewise.models import build, gpt_parallel
from stagewise.models.gpt import GPTConfig
from stagewise.partition import balance, layers_of
from stagewise.pipeline import Pipeline, PipelineOptions

BATCH, SEQ = 4, 32
"""A small batch: the state measured does not depend on it, and gpt-small's step stays seconds on a CPU."""


def held_bytes(params: list[nn.Parameter], optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the parameters, their gradients and the optimizer's state on this rank, each storage once."""
    tensors: list[torch.Tensor] = []
    for p in params:
        tensors.append(p)
        if p.grad is not None:
            tensors.append(p.grad)
    for state in optimizer.state.values():
        tensors += [v for v in state.values() if isinstance(v, torch.Tensor)]
    seen: dict[int, int] = {}
    for t in tensors:
        part = t.to_local() if isinstance(t, DTensor) else t
        storage = part.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, 50304, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    return ids, torch.roll(ids, -1, dims=1)


def unsplit(model: str) -> int:
    torch.manual_seed(0)
    net = build(model)
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-4)
    ids, targets = batch()
    GPTConfig.loss(net(ids), targets).backward()
    optimizer.step()
    return held_bytes(list(net.parameters()), optimizer)


def rank_bytes(model: str, layouts: list[tuple[int, int, int, int]]) -> list[dict[str, Any]]:
    torch.set_num_threads(1)
    meshes: dict[tuple[int, int, int, int], PipelineMesh] = {}
    out = []
    for layout in layouts:
        pp, dp, fsdp, tp = layout
        if layout not in meshes:
            meshes[layout] = init_mesh(pp, dp, fsdp=fsdp, tp=tp, timeout=600)
        mesh = meshes[layout]
        meta = build(model, device="meta")
        layers = layers_of(meta)
        sizes = [float(sum(p.numel() for p in layer.module.parameters())) for layer in layers]
        part = balance(sizes, pp)  # by parameters: the state measured here
        pipe = Pipeline(
            meta, part, n_microbatches=1, loss_fn=GPTConfig.loss, mesh=mesh,  # type: ignore[arg-type]
            options=PipelineOptions(tensor_parallel=gpt_parallel.plan),
        )  # fmt: skip
        optimizer = torch.optim.AdamW(pipe.parameters(), lr=1e-4)
        ids, targets = batch()
        mine = mesh.share(BATCH)
        pipe.step(ids[mine], targets[mine])
        optimizer.step()
        held = {id(q): q.numel() for s in pipe.stages for i in part.layers(s) for q in layers[i].module.parameters()}
        stage_params = sum(held.values())  # a tied weight once per rank that holds it
        out.append({"bytes": held_bytes(list(pipe.parameters()), optimizer), "stage_params": stage_params})
        pipe.close()
        del pipe, optimizer
    dist.destroy_process_group()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt-small")
    parser.add_argument("--layouts", default="1x1x4x1,1x1x2x2,1x1x1x4,2x1x2x1,2x1x1x2,2x2x1x1,4x1x1x1")
    ns = parser.parse_args()
    layouts = [tuple(int(v) for v in text.split("x")) for text in ns.layouts.split(",")]
    whole = unsplit(ns.model)
    model_params = sum(p.numel() for p in build(ns.model, device="meta").parameters())
    per_rank = launch(rank_bytes, 4, ns.model, layouts)
    for i, layout in enumerate(layouts):
        pp, dp, fsdp, tp = layout
        got = [per_rank[r][i]["bytes"] for r in sorted(per_rank)]
        target = 1 / (pp * fsdp * tp)
        largest = max(got) / whole
        split_share = max(per_rank[r][i]["stage_params"] for r in per_rank) / model_params
        row = {
            "model": ns.model, "layout": f"pp{pp} x dp{dp} x fsdp{fsdp} x tp{tp}", "unsplit_bytes": whole,
            "rank_bytes": got, "largest_over_unsplit": round(largest, 4), "target": round(target, 4),
            "ratio_to_target": round(largest / target, 4), "split_share": round(split_share, 4),
            "ratio_to_split_target": round(largest / (split_share / (fsdp * tp)), 4),
        }  # fmt: skip
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
