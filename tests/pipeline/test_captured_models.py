"""Models that are not chains, captured and split automatically, train on 2 gloo processes exactly as unsplit."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from support.multiproc import run_ranks
from torch import nn
from torch.distributed.pipelining import Schedule1F1B

from stagewise.comm import init_mesh
from stagewise.models.nonchain import MaskedTransformer, UNetMLP
from stagewise.partition import auto, capture, layers_of, shared_parameters
from stagewise.pipeline import Pipeline, PipelineOptions, WeightGradientFusion, torch_pipe

STEPS = 3
BATCH = 7  # not a multiple of the 3 micro-batches: sizes 3, 2, 2
MICRO = 3


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def build(kind: str) -> nn.Module:
    torch.manual_seed(11)
    return MaskedTransformer(vocab=32, d_model=16, n_heads=2, n_layers=4) if kind == "transformer" else UNetMLP()


def batches(kind: str, size: int = BATCH) -> list[tuple[tuple[torch.Tensor, ...], torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    out = []
    for _ in range(STEPS):
        if kind == "transformer":
            ids = torch.randint(0, 32, (size, 9), generator=g)
            mask = torch.ones(size, 8, dtype=torch.long)
            lengths = torch.randint(3, 9, (size,), generator=g)
            mask[torch.arange(8)[None, :] >= lengths[:, None]] = 0  # right padding
            out.append(((ids[:, :-1], mask), ids[:, 1:]))
        else:
            out.append(((torch.randn(size, 16, generator=g),), torch.randn(size, 4, generator=g)))
    return out


def loss_of(kind: str) -> Any:
    return lm_loss if kind == "transformer" else F.mse_loss


def unsplit(kind: str) -> dict[str, Any]:
    model = build(kind)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for inputs, targets in batches(kind):
        opt.zero_grad()
        loss = loss_of(kind)(model(*inputs), targets)
        loss.backward()
        losses.append(loss.item())
        opt.step()
    return {"losses": losses, "params": model.state_dict()}


def train_captured(kind: str, schedule: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    mesh = init_mesh(2, timeout=30)
    model = build(kind)
    example, _ = batches(kind, size=MICRO)[0]
    chain = capture(model, example)
    part = auto(chain, 2, example, by="flops")  # the split points, chosen by the partitioner
    pipe = Pipeline(
        chain, part, schedule=schedule, n_microbatches=MICRO, loss_fn=loss_of(kind), mesh=mesh,  # type: ignore[arg-type]
        # a segment's graph calls aten.linear: fuse it
        options=PipelineOptions(fuse_weight_gradients=WeightGradientFusion.every()),
    )  # fmt: skip
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    losses = []
    for inputs, targets in batches(kind):
        opt.zero_grad()
        losses.append(pipe.step(inputs, targets).item())
        opt.step()
    dist.destroy_process_group()
    return {"losses": losses, "params": pipe.state_dict(), "bounds": part.bounds, "names": part.names}


def check(results: dict[int, dict[str, Any]], want: dict[str, Any]) -> None:
    merged: dict[str, torch.Tensor] = {}
    for got in results.values():
        torch.testing.assert_close(got["losses"], want["losses"], atol=1e-5, rtol=1e-5)
        merged.update(got["params"])
    assert sorted(merged) == sorted(want["params"])
    for name, value in want["params"].items():
        torch.testing.assert_close(merged[name], value, atol=1e-5, rtol=1e-5, msg=name)


def test_a_masked_transformer_trains_as_the_unsplit_model() -> None:
    results = run_ranks(train_captured, 2, "transformer", "1f1b", timeout=120)
    check(results, unsplit("transformer"))
    # the embedding is a segment of its own, so a split lands between two blocks
    assert results[0]["names"][0] == "<input>" and len(results[0]["bounds"]) == 3


def test_a_model_with_long_skip_connections_trains_as_the_unsplit_model() -> None:
    # zero-bubble splits each backward in two; the mixing weights of the skips are tied across both stages
    check(run_ranks(train_captured, 2, "skip", "zero-bubble", timeout=120), unsplit("skip"))


def torch_and_stagewise(kind: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    mesh = init_mesh(2, timeout=30)
    rank = dist.get_rank()
    (inputs, targets), size = batches(kind, size=6)[0], 2  # torch's stages take micro-batches of one shape
    example = tuple(t[:size] for t in inputs)
    chain = capture(build(kind), example)
    part = auto(chain, 2, example, by="flops")
    pipe = Pipeline(chain, part, schedule="1f1b", n_microbatches=3, loss_fn=loss_of(kind), mesh=mesh)
    ours = pipe.step(inputs, targets).item()
    tied = {name for tie in shared_parameters(layers_of(chain)) for name in tie.names}  # torch does not sum these
    our_grads = {n: p.grad.clone() for n, p in pipe.named_parameters() if p.grad is not None and n not in tied}

    theirs = torch_pipe(capture(build(kind), example), part, example)
    stage = theirs.build_stage(rank, torch.device("cpu"), mesh.pp_group)
    schedule = Schedule1F1B(stage, n_microbatches=3, loss_fn=loss_of(kind))
    losses: list[torch.Tensor] = []
    if rank == 0:
        schedule.step(*inputs)
    else:
        schedule.step(target=targets, losses=losses)
    their_grads = {n: p.grad for n, p in stage.submod.named_parameters() if p.grad is not None and n not in tied}
    dist.destroy_process_group()
    return {
        "ours": ours,
        "theirs": float(torch.stack(losses).mean()) if losses else None,
        "ours_grads": our_grads,
        "their_grads": their_grads,
    }


def test_the_same_partition_runs_under_torchs_schedule_with_the_same_loss() -> None:
    results = run_ranks(torch_and_stagewise, 2, "skip", timeout=120)
    last = results[1]
    assert last["theirs"] is not None
    assert abs(last["theirs"] - last["ours"]) < 1e-5, (last["theirs"], last["ours"])
    for got in results.values():
        assert sorted(got["their_grads"]) == sorted(got["ours_grads"])  # the same parameters on each rank
        for name, grad in got["ours_grads"].items():
            torch.testing.assert_close(got["their_grads"][name], grad, atol=1e-5, rtol=1e-5, msg=name)
