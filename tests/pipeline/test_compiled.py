"""Compiled stages (inductor's kernels) equal the unsplit eager model under 1F1B and zero-bubble, and compile once.

One launch of 2 gloo processes compiles a small GPT's layers with inductor and trains it 3 AdamW steps with
clipping under each schedule. Compiled kernels fuse and reorder floating-point work, so the comparison with
the eager unsplit model is at atol 1e-4 (eager pipelines are compared at 1e-5).
"""

from __future__ import annotations

import traceback
from typing import Any

import pytest
import torch
import torch.distributed as dist
from support import gpt_steps
from support.gpt_steps import CLIP, batches
from support.multiproc import run_ranks

from stagewise.comm import PipelineMesh, init_mesh
from stagewise.models.gpt import GPTConfig
from stagewise.partition import Partition
from stagewise.pipeline import Compute, Pipeline, PipelineOptions

SCHEDULES = ("1f1b", "zero-bubble")
BOUNDS = (0, 1, 7)
"""The embedding on rank 0; the 4 blocks, the final norm and the head (tied to the embedding) on rank 1: one
class of layer to compile on each rank, as the two compile at once."""


def train(schedule: str, mesh: PipelineMesh) -> dict[str, Any]:
    pipe = Pipeline(
        gpt_steps.model(tied=True), Partition.from_bounds(BOUNDS), schedule=schedule,  # type: ignore[arg-type]
        n_microbatches=2, loss_fn=GPTConfig.loss, mesh=mesh,  # type: ignore[arg-type]
        options=PipelineOptions(compute=Compute(compile=True)),
    )  # fmt: skip
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-3)
    losses, norms, grads, graphs = [], [], [], []
    for ids, targets in batches():
        opt.zero_grad()
        losses.append(pipe.step(ids, targets).item())
        graphs.append(pipe.compiled_graphs)
        grads.append({n: p.grad.detach().clone() for n, p in pipe.named_parameters() if p.grad is not None})
        norms.append(float(pipe.clip_grad_norm_(CLIP)))
        opt.step()
    classes = len({type(layer) for stage in pipe.stages.values() for layer in stage.layers})
    params = {n: p.detach().clone() for n, p in pipe.named_parameters()}
    pipe.close()
    return {"losses": losses, "norms": norms, "grads": grads, "params": params, "graphs": graphs, "classes": classes}


def train_both() -> dict[str, Any]:
    torch.set_num_threads(1)
    torch._inductor.config.compile_threads = 1  # the ranks already take every core: no pool of compile workers
    mesh = init_mesh(2, timeout=300)  # a first compilation takes tens of seconds on a loaded CPU
    out: dict[str, Any] = {}
    for schedule in SCHEDULES:
        try:
            out[schedule] = train(schedule, mesh)
        except Exception:  # reported by the schedule's own test
            out[schedule] = traceback.format_exc()
    dist.destroy_process_group()
    return out


@pytest.fixture(scope="module")
def outcomes() -> dict[int, dict[str, Any]]:
    """Both schedules on one launch of 2 processes: rank -> schedule -> its results, or the traceback it raised."""
    per_rank: dict[int, dict[str, Any]] = run_ranks(train_both, 2, timeout=400)
    return per_rank


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_compiled_stages_equal_the_unsplit_model(schedule: str, outcomes: dict[int, dict[str, Any]]) -> None:
    want = gpt_steps.unsplit(tied=True)
    close: dict[str, Any] = {"atol": 1e-4, "rtol": 1e-4}
    for rank, results in outcomes.items():
        got = results[schedule]
        assert not isinstance(got, str), f"rank {rank}: {got}"
        torch.testing.assert_close(got["losses"], want["losses"], **close, msg=f"rank {rank}")
        torch.testing.assert_close(got["norms"], want["norms"], **close, msg=f"rank {rank}")
        for step, grads in enumerate(got["grads"]):
            assert grads, f"rank {rank} has no gradients at step {step}"
            for name, grad in grads.items():
                torch.testing.assert_close(grad, want["grads"][step][name], **close, msg=name)
        for name, param in got["params"].items():
            torch.testing.assert_close(param, want["params"][name], **close, msg=name)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_equal_shapes_compile_nothing_after_the_first_step(schedule: str, outcomes: dict[int, dict[str, Any]]) -> None:
    for rank, results in outcomes.items():
        got = results[schedule]
        assert not isinstance(got, str), f"rank {rank}: {got}"
        first, *rest = got["graphs"]
        # Layers of one class share their graphs: at most one per class, however many micro-batches ran.
        assert 0 < first <= got["classes"], f"rank {rank}: {got['graphs']}"
        assert rest == [first, first], f"rank {rank}: {got['graphs']}"


def test_compile_takes_a_switch_or_a_backend_name() -> None:
    assert Compute(compile=True).compile is True and Compute(compile="aot_eager").compile == "aot_eager"
    with pytest.raises(
        ValueError, match=r"^Compute.compile names no torch.compile backend: 'inductr'; choose among \["
    ):
        Compute(compile="inductr")
    with pytest.raises(TypeError, match=r"^Compute.compile must be True, False or a torch.compile backend's name"):
        Compute(compile=1)  # type: ignore[arg-type]
