"""Each rank's bytes of expert parameters and of their AdamW state under expert parallelism, at ep = 1, 2, 4.

One launch of 4 gloo processes builds the training job's pipeline (:func:`stagewise.run.build_pipeline`) of a
mixture-of-experts preset in each layout, trains one step with AdamW, and each rank sums the bytes it holds (a
DTensor by its local shard): the experts' parameters, their optimizer state (``exp_avg`` and ``exp_avg_sq``; each
parameter's ``step`` is one scalar, left out) and the other parameters with their state. One JSON line per layout:
every rank's figures, the model's expert bytes, and the largest rank's expert share against the target ``1 / ep``.

    python benchmarks/expert_memory.py [--model gpt-moe-tiny] [--layouts 1x4x1x1,1x1x4x2,...]  # pp x dp x fsdp x ep
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from stagewise.comm import launch
from stagewise.models import PRESETS
from stagewise.pipeline import Pipeline
from stagewise.run import TrainConfig, build_pipeline

LAYOUTS = "1x4x1x1,1x4x1x2,1x4x1x4,1x1x4x2,1x1x4x4"
"""``pp x dp x fsdp x ep``: the experts split over 1, 2 or 4 of a stage's 4 ranks, borrowed from dp or FSDP."""


def _bytes(t: torch.Tensor) -> int:
    local = t.to_local() if isinstance(t, DTensor) else t
    return local.numel() * local.element_size()


def measured(pipe: Pipeline, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """This rank's bytes: expert parameters and their state, the other parameters and theirs."""
    out = dict.fromkeys(("expert_params", "expert_state", "other_params", "other_state"), 0)
    for name, param in pipe.named_parameters():
        kind = "expert" if ".experts." in name else "other"
        out[f"{kind}_params"] += _bytes(param)
        state = optimizer.state.get(param, {})
        out[f"{kind}_state"] += sum(_bytes(v) for k, v in state.items() if k != "step")
    return out


def layouts(model: str, specs: list[str]) -> list[dict[str, Any]]:
    """Every layout's figures on this rank."""
    torch.set_num_threads(1)
    out = []
    for spec in specs:
        pp, dp, fsdp, ep = (int(x) for x in spec.split("x"))
        config = TrainConfig(
            model=model, pp=pp, dp=dp, fsdp=fsdp, ep=ep, microbatches=2, batch_size=8, seq_len=16, timeout=120
        )
        pipe = build_pipeline(config)
        optimizer = torch.optim.AdamW(pipe.parameters(), lr=1e-3)
        ids = torch.randint(0, 256, (config.batch_size, config.seq_len), generator=torch.Generator().manual_seed(0))
        mine = pipe.mesh.share(config.batch_size)
        pipe.step(ids[mine], torch.roll(ids, -1, dims=1)[mine])
        optimizer.step()
        out.append({"layout": f"pp{pp} x dp{dp} x fsdp{fsdp}", "ep": ep, **measured(pipe, optimizer)})
        pipe.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="gpt-moe-tiny")
    parser.add_argument("--layouts", default=LAYOUTS)
    ns = parser.parse_args()
    specs = ns.layouts.split(",")
    whole_model = PRESETS[ns.model].build(device="meta")
    expert_bytes = sum(p.numel() * p.element_size() for n, p in whole_model.named_parameters() if ".experts." in n)
    per_rank = launch(layouts, 4, ns.model, specs, start_method="forkserver")
    for index in range(len(specs)):
        ranks = [per_rank[r][index] for r in sorted(per_rank)]
        largest = max(r["expert_params"] for r in ranks)
        row = {
            **{k: ranks[0][k] for k in ("layout", "ep")},
            "model": ns.model,
            "model_expert_bytes": expert_bytes,
            "ranks": [{k: v for k, v in r.items() if k not in ("layout", "ep")} for r in ranks],
            "largest_expert_share": largest / expert_bytes,
            "target": 1 / ranks[0]["ep"],
            "state_over_params": max(r["expert_state"] for r in ranks) / largest,
        }
        print(json.dumps(row))


if __name__ == "__main__":
    main()
