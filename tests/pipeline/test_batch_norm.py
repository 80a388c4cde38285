"""Deferred batch norm: a pipeline's running statistics move once per step, by the whole batch, as the unsplit
model's would; each micro-batch is still normalised by its own statistics, as gradient accumulation does."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from support.multiproc import run_ranks
from support.resnet import resnet
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from stagewise.comm import init_mesh
from stagewise.partition import Partition
from stagewise.pipeline import Compute, Pipeline, PipelineOptions
from stagewise.pipeline.batch_norm import deferred_mode

STEPS = 3
BATCH = 7  # micro-batches of 3, 2, 2 (or 4, 3)
SEED = 2
CASES: tuple[tuple[str, int, bool], ...] = (("gpipe", 3, False), ("1f1b", 2, False), ("1f1b", 3, True))
"""(schedule, micro-batches, activation checkpointing) on 2 stages."""
STATISTICS = ("running_mean", "running_var", "num_batches_tracked")


def batches(replicas: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    return [
        (
            torch.randn(BATCH * replicas, 3, 8, 8, generator=g) * 2 + 1,
            torch.randint(0, 10, (BATCH * replicas,), generator=g),
        )
        for _ in range(STEPS)
    ]


def model() -> nn.Sequential:
    torch.manual_seed(SEED)
    return resnet()


def unsplit(m: int, replicas: int = 1) -> dict[str, torch.Tensor]:
    """The unsplit model trained by gradient accumulation over the same micro-batches (each normalised by its own
    statistics, averaged over the replicas), whose batch norms' running statistics move once per step: by torch's
    own batch norm on all the inputs each saw in the step, the global batch's."""
    net = model()
    norms = [n for n in net.modules() if isinstance(n, _BatchNorm)]
    seen: dict[int, list[torch.Tensor]] = {id(n): [] for n in norms}
    for norm in norms:
        norm.register_forward_pre_hook(lambda module, args: seen[id(module)].append(args[0].detach()))
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    for x, y in batches(replicas):
        opt.zero_grad()
        for norm in norms:
            norm.track_running_stats = False
        for xr, yr in zip(x.chunk(replicas), y.chunk(replicas), strict=True):
            for xs, ys in zip(xr.tensor_split(m), yr.tensor_split(m), strict=True):
                (F.cross_entropy(net(xs), ys) * len(xs) / len(xr) / replicas).backward()
        with torch.no_grad():
            for norm in norms:
                norm.track_running_stats = True
                inputs = seen[id(norm)]
                norm.forward(torch.cat(inputs))  # once, by the whole batch of its inputs (forward: no hook)
                inputs.clear()
        opt.step()
    return net.state_dict()


def trained(pipe: Pipeline, data: list[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, torch.Tensor]:
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    for x, y in data:
        opt.zero_grad()
        pipe.step(x, y)
        opt.step()
    pipe.eval()
    pipe.evaluate(data[0][0], data[0][1])  # forward only, in evaluation mode: moves nothing
    return pipe.state_dict()


def every_case() -> dict[str, Any]:
    torch.set_num_threads(1)
    results: dict[str, Any] = {}
    mesh = init_mesh(2, timeout=60)
    for schedule, m, recompute in CASES:
        options = PipelineOptions(compute=Compute(activation_checkpointing=recompute))
        pipe = Pipeline(model(), Partition.from_bounds((0, 2, 4)), schedule=schedule, n_microbatches=m,
                        loss_fn=F.cross_entropy, mesh=mesh, options=options)  # fmt: skip
        results[f"{schedule} m={m} recompute={recompute}"] = {
            "mode": pipe.batch_norm,
            "state": trained(pipe, batches()),
        }
        pipe.close()
    dist.destroy_process_group()
    mesh = init_mesh(1, 2, timeout=60)  # the same processes as 2 replicas of 1 stage
    share = [(x.chunk(2)[mesh.replica], y.chunk(2)[mesh.replica]) for x, y in batches(2)]
    options = PipelineOptions(batch_norm="deferred-global")
    pipe = Pipeline(model(), Partition.from_bounds((0, 4)), schedule="1f1b", n_microbatches=3,
                    loss_fn=F.cross_entropy, mesh=mesh, options=options)  # fmt: skip
    results["dp=2 deferred-global"] = {"mode": pipe.batch_norm, "state": trained(pipe, share)}
    pipe.close()
    dist.destroy_process_group()
    return results


def test_running_statistics_move_once_per_step_by_the_whole_batch_as_the_unsplit_models() -> None:
    results = run_ranks(every_case, 2, timeout=180)
    for schedule, m, recompute in CASES:
        case = f"{schedule} m={m} recompute={recompute}"
        want = unsplit(m)
        merged = {k: v for got in results.values() for k, v in got[case]["state"].items()}
        assert sorted(merged) == sorted(want), case
        assert all(got[case]["mode"] == "deferred" for got in results.values())  # the default with batch norms
        for name, value in want.items():
            torch.testing.assert_close(merged[name], value, atol=1e-5, rtol=1e-5, msg=f"{case}: {name}")
        assert int(merged["0.1.num_batches_tracked"]) == STEPS, case  # not STEPS x m
    want = unsplit(3, replicas=2)
    for rank, got in results.items():
        for name, value in want.items():
            torch.testing.assert_close(got["dp=2 deferred-global"]["state"][name], value, atol=1e-5, rtol=1e-5,
                                       msg=f"rank {rank}: {name}")  # fmt: skip


def test_a_batch_norm_mode_that_does_not_exist_is_refused() -> None:
    with pytest.raises(ValueError, match=r"PipelineOptions.batch_norm must be one of \['micro-batch', 'deferred', "):
        PipelineOptions(batch_norm="global")  # type: ignore[arg-type]


def test_the_default_defers_where_batch_norms_run_as_modules_over_several_micro_batches() -> None:
    norms = [nn.BatchNorm1d(4)]
    assert deferred_mode(None, norms, 3, captured=False) == "deferred"
    assert deferred_mode(None, norms, 1, captured=False) == "micro-batch"  # one micro-batch is the whole batch
    assert deferred_mode(None, [], 3, captured=False) == "micro-batch"
    assert deferred_mode(None, norms, 3, captured=True) == "micro-batch"  # ops of a captured graph
    with pytest.raises(ValueError, match=r"batch_norm='deferred' defers .* but this model was captured"):
        deferred_mode("deferred", norms, 3, captured=True)
