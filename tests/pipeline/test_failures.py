"""Bad steps fail loudly: a NaN loss raises or is skipped, a stage names the input it could not take, no pickling."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from support.multiproc import run_ranks
from torch import nn

from stagewise.comm import LaunchError, init_mesh
from stagewise.partition import Partition
from stagewise.pipeline import Loss, Pipeline, PipelineOptions


def poisoned(policy: str) -> dict[str, Any]:
    """Three SGD steps; micro-batch 1 of step 2 holds an infinite input."""
    torch.set_num_threads(1)
    mesh = init_mesh(2, timeout=20)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.GELU(), nn.Linear(4, 4), nn.Linear(4, 2))
    pipe = Pipeline(
        model, Partition.from_bounds((0, 2, 4)), n_microbatches=3, loss_fn=F.mse_loss, mesh=mesh,
        options=PipelineOptions(loss=Loss(nonfinite=policy)),  # type: ignore[arg-type]
    )  # fmt: skip
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    skipped, snapshots = [], []
    for step in range(3):
        x, y = torch.randn(6, 4), torch.randn(6, 2)
        if step == 1:
            x[2, 0] = float("inf")  # rows 2-3 form micro-batch 1
        opt.zero_grad()
        pipe.step(x, y)
        skipped.append(pipe.skipped)
        opt.step()
        snapshots.append({n: p.detach().clone() for n, p in pipe.named_parameters()})
    dist.destroy_process_group()
    return {"skipped": skipped, "snapshots": snapshots}


def test_a_non_finite_loss_raises_with_step_and_microbatch() -> None:
    try:
        run_ranks(poisoned, 2, "raise", timeout=120)
    except LaunchError as err:
        messages = [f.message for f in err.failures]
        assert any("at step 2 (first non-finite: micro-batch 1 of replica 0)" in m for m in messages), messages
        assert any("NonFiniteLossError" in m or "the loss is nan" in m for m in messages), messages
    else:
        raise AssertionError("training went on through a NaN loss")


def test_skip_drops_the_step_and_training_goes_on() -> None:
    results = run_ranks(poisoned, 2, "skip", timeout=120)
    for got in results.values():
        assert got["skipped"] == [False, True, False]
        before, during, after = got["snapshots"]
        for name in before:
            assert torch.equal(before[name], during[name]), name  # the bad step changed nothing
            assert torch.isfinite(after[name]).all() and not torch.equal(during[name], after[name]), name


def accumulate_then_poison() -> dict[str, list[bool]]:
    """A good step, then a poisoned one without zeroing the gradients: the first step's gradients must survive."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.GELU(), nn.Linear(4, 4), nn.Linear(4, 2))
    pipe = Pipeline(model, Partition.from_bounds((0, 2, 4)), n_microbatches=3, loss_fn=F.mse_loss,
                    mesh=init_mesh(2, timeout=20),
                    options=PipelineOptions(loss=Loss(nonfinite="skip")))  # fmt: skip
    x, y = torch.randn(6, 4), torch.randn(6, 2)
    pipe.step(x, y)
    first = {n: p.grad.clone() for n, p in pipe.named_parameters() if p.grad is not None}
    x[2, 0] = float("inf")
    pipe.step(x, y)
    kept = {n: [pipe.skipped, p.grad is not None and torch.equal(p.grad, first[n])] for n, p in pipe.named_parameters()}
    dist.destroy_process_group()
    return kept


def test_a_skipped_step_keeps_the_gradients_of_earlier_steps() -> None:
    for kept in run_ranks(accumulate_then_poison, 2, timeout=120).values():
        assert kept and all(skipped and same for skipped, same in kept.values()), kept


def without_pickle() -> int:
    """Training steps with every pickle entry point replaced by one that fails: the loop must not pickle."""
    import pickle

    torch.set_num_threads(1)
    mesh = init_mesh(2, timeout=60)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.GELU(), nn.Linear(4, 4), nn.Linear(4, 2))
    pipe = Pipeline(model, Partition.from_bounds((0, 2, 4)), n_microbatches=3, loss_fn=F.mse_loss, mesh=mesh)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("pickle was used during a training step")

    import torch.distributed.distributed_c10d as c10d

    # torch's object collectives keep their own aliases of the pickler: replace those too.
    targets = [(pickle, n) for n in ("dumps", "loads", "dump", "load", "Pickler", "Unpickler")]
    targets += [(c10d, "_pickler"), (c10d, "_unpickler")]
    saved = {(module, name): getattr(module, name) for module, name in targets}
    for module, name in saved:
        setattr(module, name, refuse)
    try:
        for step in range(3):
            opt.zero_grad()
            x = torch.randn(5 + step, 4)  # shapes change, so metadata travels again
            pipe.step(x, torch.randn(5 + step, 2))
            pipe.clip_grad_norm_(1.0)
            opt.step()
    finally:
        for (module, name), value in saved.items():
            setattr(module, name, value)
    dist.destroy_process_group()
    return pipe.steps


def test_training_steps_pickle_nothing() -> None:
    assert run_ranks(without_pickle, 2, timeout=120) == {0: 3, 1: 3}


def mismatched(case: str) -> None:
    torch.set_num_threads(1)
    mesh = init_mesh(2, timeout=5)
    width = 5 if case == "shape" else 4  # stage 1 expects 5 features but stage 0 makes 4
    model = nn.Sequential(nn.Linear(4, 4), nn.GELU(), nn.Linear(width, 2))
    part = Partition.from_bounds((0, 2, 3))
    pipe = Pipeline(model, part, n_microbatches=2, loss_fn=F.mse_loss, mesh=mesh)
    x = torch.randn(4, 4, dtype=torch.float64 if case == "dtype" else torch.float32)
    pipe.step(x, torch.randn(4, 2))


def first_failure(case: str) -> str:
    """The message of the first rank to fail in ``mismatched(case)``."""
    try:
        run_ranks(mismatched, 2, case, timeout=120)
    except LaunchError as err:
        return err.failures[0].message
    raise AssertionError(f"mismatched stages ({case}) trained without an error")


def test_a_stage_that_cannot_take_its_input_names_both_stages() -> None:
    first = first_failure("shape")
    assert "stage 1 (layers 2 .. 2) failed in the forward of micro-batch 0 on its input [(2, 4) float32], " in first
    assert "which stage 0 sent: RuntimeError: mat1 and mat2 shapes cannot be multiplied" in first
    first = first_failure("dtype")
    assert "stage 0 (layers 0 .. 1) failed in the forward of micro-batch 0 on its input [(2, 4) float64], " in first
    assert "the inputs passed to step(): RuntimeError:" in first
