"""Pipeline: initialisation by (seed, layer), meta models, predict, traces, custom schedules, and refusals."""

from __future__ import annotations

import json
import os
import time
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from support.chains import Chain, mse, reference
from support.multiproc import run_ranks

from stagewise.comm import LaunchError, init_mesh
from stagewise.models import GPT, GPTConfig
from stagewise.partition import Partition, layers_of
from stagewise.pipeline import Compute, Diagnostics, Pipeline, PipelineOptions, WeightGradientFusion, materialise_model
from stagewise.schedule import Schedule, build, validate

CONFIG = GPTConfig(vocab_size=32, seq_len=8, d_model=16, n_layers=4, n_heads=2)  # 7 layers
SPLITS = {1: (0, 7), 2: (0, 3, 7), 3: (0, 2, 5, 7)}


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def gpt_on_meta(n_ranks: int) -> dict[str, object]:
    torch.set_num_threads(1)
    mesh = init_mesh(n_ranks, timeout=30)
    model = GPT(CONFIG, device="meta")
    pipe = Pipeline(
        model,
        Partition.from_bounds(SPLITS[n_ranks]),
        n_microbatches=2,
        loss_fn=lm_loss,
        mesh=mesh,
        options=PipelineOptions(seed=7),
    )
    allocated = sum(p.numel() for p in model.parameters() if not p.is_meta)
    own = sum(p.numel() for p in pipe.parameters())
    initial = {k: v.clone() for k, v in pipe.state_dict().items()}
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 32, (5, 8), generator=g)
    targets = torch.randint(0, 32, (5, 8), generator=g)
    loss = pipe.step(ids, targets).item()
    logits = pipe.predict(ids)
    dist.destroy_process_group()
    return {"allocated": allocated, "own": own, "initial": initial, "loss": loss, "logits": logits}


def test_same_seed_same_model_for_any_stage_count_and_no_foreign_layers() -> None:
    reference_model = materialise_model(GPT(CONFIG, device="meta"), seed=7)
    want = reference_model.state_dict()
    g = torch.Generator().manual_seed(0)
    ids, targets = torch.randint(0, 32, (5, 8), generator=g), torch.randint(0, 32, (5, 8), generator=g)
    want_loss = lm_loss(reference_model(ids), targets).item()
    for n_ranks in (1, 2, 3):
        results = run_ranks(gpt_on_meta, n_ranks, n_ranks)
        got: dict[str, torch.Tensor] = {}
        for result in results.values():
            # Each rank allocated exactly its own stage's parameters, and nothing of the others'.
            assert result["allocated"] == result["own"] > 0
            got.update(result["initial"])
            assert result["loss"] == pytest.approx(want_loss, abs=1e-5)
        assert got.keys() == want.keys()
        for name, value in want.items():
            torch.testing.assert_close(got[name], value, atol=0, rtol=0, msg=f"{name} with {n_ranks} stages")
        last = results[n_ranks - 1]["logits"]
        torch.testing.assert_close(last, reference_model(ids), atol=1e-5, rtol=1e-5)
        assert all(results[r]["logits"] is None for r in range(n_ranks - 1))


class Same(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.view(x.shape)


class Half(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[:, :2]


SCORED: list[weakref.ref[torch.Tensor]] = []
"""The outputs :func:`counting_mse` has scored, while they live."""


def counting_mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The mean squared error; first notes in ``HELD`` how many outputs it scored before are still alive."""
    HELD.append(sum(r() is not None for r in SCORED))
    SCORED.append(weakref.ref(out))
    return mse(out, target)


HELD: list[int] = []


def views_of_inputs() -> tuple[list[torch.Tensor], list[int]] | None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), Same(), Half())
    pipe = Pipeline(model, Partition.from_bounds((0, 1, 2, 3)), n_microbatches=4, loss_fn=counting_mse,
                    mesh=init_mesh(3))  # fmt: skip
    first = pipe.predict(torch.arange(32.0).reshape(8, 4))
    kept = None if first is None else first.clone()
    second = pipe.predict(torch.arange(32.0).reshape(8, 4) + 1)
    x = torch.arange(32.0).reshape(8, 4)
    loss = pipe.evaluate(x, x[:, :2] / 10)
    pipe.evaluate(x, x[:, :2] / 10)
    # A loss that is a view of the output, itself a view of a received buffer: the losses kept must not change
    # when a later run reuses that buffer.
    torch.manual_seed(0)
    viewing = Pipeline(torch.nn.Sequential(torch.nn.Linear(4, 6), Same(), Half()), Partition.from_bounds((0, 1, 2, 3)),
                       n_microbatches=4, loss_fn=first_value, mesh=pipe.mesh)  # fmt: skip
    viewing.evaluate(x, x)
    scored = viewing._last_result.microbatch_losses if viewing._last_result is not None else []
    viewing.evaluate(x + 100, x)
    dist.destroy_process_group()
    return None if first is None or second is None else ([kept, first, second, loss, torch.stack(scored)], HELD)


def first_value(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The output's first value: a view of it."""
    return out[0, 0]


def test_predict_keeps_outputs_that_are_views_of_received_buffers() -> None:
    # The middle stage returns a view of what it received, and the last stage a slice of it: neither buffer
    # may be reused by a later receive while the view is being sent or has been returned.
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), Same(), Half())
    x = torch.arange(32.0).reshape(8, 4)
    (kept, first, second, loss, scored), held = run_ranks(views_of_inputs, 3)[2]  # type: ignore[misc]
    with torch.no_grad():  # micro-batched GEMMs round differently from the whole batch's (up to 2e-6 here)
        torch.testing.assert_close(first, model(x), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(first, kept, atol=0, rtol=0)
        torch.testing.assert_close(second, model(x + 1), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(loss, mse(model(x), x[:, :2] / 10), atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(scored, model(x)[::2, 0], atol=1e-5, rtol=1e-5)  # each micro-batch's first row
    # evaluate() scores each micro-batch's output as it arrives and keeps none: it held all of them until the
    # last was scored, and the pipeline held the last evaluation's while the next ran (a language model's logits,
    # 2 x n_microbatches of them, made its peak memory).
    assert held == [0] * 8  # two evaluations of 4 micro-batches


class _SlowBackward(torch.autograd.Function):
    """The identity, whose backward takes a while: the stage's gradients reach the next rank late."""

    @staticmethod
    def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:
        time.sleep(0.3)
        return grad


class SlowBackward(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _SlowBackward.apply(x)  # type: ignore[no-any-return]


def passing_views() -> torch.nn.Sequential:
    torch.manual_seed(0)
    middle = torch.nn.Unflatten(1, (2, 4))  # its input gradient is a view of the gradient it receives
    return torch.nn.Sequential(torch.nn.Linear(8, 8), SlowBackward(), middle, torch.nn.Flatten(), torch.nn.Linear(8, 8))


def gradients_passed_as_views(fusion: bool) -> dict[str, torch.Tensor]:
    torch.set_num_threads(1)
    options = PipelineOptions() if fusion else PipelineOptions(fuse_weight_gradients=WeightGradientFusion.off())
    pipe = Pipeline(
        passing_views(), Partition.from_bounds((0, 2, 3, 5)), n_microbatches=4, loss_fn=mse, mesh=init_mesh(3),
        options=options,
    )  # fmt: skip
    torch.manual_seed(1)
    pipe.step(torch.randn(8, 8), torch.randn(8, 8))
    grads = {name: p.grad.clone() for name, p in pipe.named_parameters() if p.grad is not None}
    dist.destroy_process_group()
    return grads


@pytest.mark.parametrize("fusion", [False, True])
def test_a_gradient_sent_on_as_a_view_of_a_received_one_is_not_overwritten(fusion: bool) -> None:
    # Stage 1 sends its input gradient, a view of the buffer it received, while stage 0 is still busy: gloo
    # reads the data only when stage 0 posts its receive, so the buffer must not take the next micro-batch's.
    model = passing_views()
    torch.manual_seed(1)
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    mse(model(x), y).backward()
    want = {name: p.grad for name, p in model.named_parameters()}
    got: dict[str, torch.Tensor] = {}
    for grads in run_ranks(gradients_passed_as_views, 3, fusion).values():
        got |= grads
    assert sorted(got) == sorted(want)
    for name, grad in got.items():
        torch.testing.assert_close(grad, want[name], atol=1e-5, rtol=1e-5, msg=name)


class _Scale(torch.autograd.Function):
    """``x * w`` with a hand-written backward: the read of ``w`` inside it runs with grad mode off."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        return x * w

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, w = ctx.saved_tensors  # type: ignore[attr-defined]
        return grad * w, (grad * x).sum(0)


class CustomScale(torch.nn.Module):
    def __init__(self, as_view: bool) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.linspace(0.5, 1.5, 6))
        self.as_view = as_view

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.w.view_as(self.w) if self.as_view else self.w
        return _Scale.apply(x, w)  # type: ignore[no-any-return]


def custom_function_model(as_view: bool) -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.Tanh(), CustomScale(as_view), torch.nn.Linear(6, 2))


def zero_bubble_through_a_custom_function(as_view: bool) -> dict[str, torch.Tensor] | str:
    torch.set_num_threads(1)
    model = custom_function_model(as_view)
    pipe = Pipeline(model, Partition.from_bounds((0, 2, 4)), schedule="zero-bubble", n_microbatches=4, loss_fn=mse,
                    mesh=init_mesh(2, timeout=20))  # fmt: skip
    torch.manual_seed(1)
    try:
        pipe.step(torch.randn(8, 6), torch.randn(8, 2))
    except Exception as err:  # the refusal, as this rank saw it
        pipe.close(wait=False)  # its transport's end: the other rank, waiting on this one, fails now
        dist.destroy_process_group()
        return f"{type(err).__name__}: {err}"
    grads = {name: p.grad.clone() for name, p in pipe.named_parameters() if p.grad is not None}
    dist.destroy_process_group()
    return grads


def test_zero_bubble_refuses_a_parameter_read_inside_a_custom_function_and_takes_a_view_of_it() -> None:
    # W starts from the ops that read each parameter; a custom Function's read is invisible to it, and its
    # gradient was lost without a word. Now it is refused; passed as a view, W starts from the view.
    refused = run_ranks(zero_bubble_through_a_custom_function, 2, False)[1]
    assert isinstance(refused, str) and refused.startswith("StageError: stage 1 (layers 2 .. 3) failed in the forward")
    assert "2.w (in _ScaleBackward) is read inside a custom torch.autograd.Function" in refused
    assert "Fn.apply(x, self.w.view_as(self.w))" in refused
    model = custom_function_model(True)
    torch.manual_seed(1)
    x, y = torch.randn(8, 6), torch.randn(8, 2)
    mse(model(x), y).backward()
    got: dict[str, torch.Tensor] = {}
    for grads in run_ranks(zero_bubble_through_a_custom_function, 2, True).values():
        assert isinstance(grads, dict)
        got |= grads
    assert sorted(got) == sorted(name for name, _ in model.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(got[name], p.grad, atol=1e-5, rtol=1e-5, msg=name)


def batch_norm_model() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(4, 4),
        torch.nn.BatchNorm1d(4),
        torch.nn.Linear(4, 4),
        torch.nn.BatchNorm1d(4),
        torch.nn.Linear(4, 2),
    )


def checkpointed_batch_norm() -> dict[str, torch.Tensor]:
    torch.set_num_threads(1)
    pipe = Pipeline(batch_norm_model(), Partition.from_bounds((0, 2, 5)), n_microbatches=1, loss_fn=mse,
                    mesh=init_mesh(2),
                    options=PipelineOptions(compute=Compute(activation_checkpointing=True)))  # fmt: skip
    torch.manual_seed(1)
    for _ in range(2):
        pipe.step(torch.randn(8, 4) * 3 + 1, torch.randn(8, 2))
    state = {k: v.clone() for k, v in pipe.state_dict().items()}
    dist.destroy_process_group()
    return state


def test_checkpointing_updates_batch_norm_statistics_once() -> None:
    # The recomputation in backward ran the batch norms in training mode again: their running statistics moved
    # twice per step, and num_batches_tracked counted 2.
    model = batch_norm_model()
    torch.manual_seed(1)
    for _ in range(2):
        mse(model(torch.randn(8, 4) * 3 + 1), torch.randn(8, 2)).backward()
    want = model.state_dict()
    got: dict[str, torch.Tensor] = {}
    for state in run_ranks(checkpointed_batch_norm, 2).values():
        got |= state
    assert sorted(got) == sorted(want)
    assert int(got["1.num_batches_tracked"]) == 2
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, atol=1e-5, rtol=1e-5, msg=key)


class WithAux(torch.nn.Module):
    """Returns its input and a 0-dim auxiliary loss, as a mixture-of-experts layer does."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x, x.pow(2).mean()


def aux_loss(out: tuple[torch.Tensor, torch.Tensor], target: torch.Tensor) -> torch.Tensor:
    return mse(out[0], target) + 0.1 * out[1]


def aux_model() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 3), WithAux())


def scalar_outputs() -> dict[str, object]:
    torch.set_num_threads(1)
    pipe = Pipeline(aux_model(), Partition.from_bounds((0, 2, 4)), n_microbatches=3, loss_fn=aux_loss,
                    mesh=init_mesh(2))  # fmt: skip
    torch.manual_seed(1)
    x, y = torch.randn(7, 4), torch.randn(7, 3)
    refused = []
    for bad in ({"x": x}, (x, None)):
        try:
            pipe.step(bad, bad)  # type: ignore[arg-type]
        except TypeError as err:
            refused.append(str(err))
    out = {"evaluated": float(pipe.evaluate(x, y)), "predicted": pipe.predict(x), "refused": refused}
    out["small"] = pipe.predict(x[:2])  # fewer samples than micro-batches: one micro-batch each
    dist.destroy_process_group()
    return out


def test_scalar_outputs_come_back_per_micro_batch_and_bad_batches_are_named() -> None:
    # predict() and evaluate() joined a 0-dim output with torch.cat and crashed where step() worked; a dict or a
    # None in the batch gave an AttributeError from .to().
    model = aux_model()
    torch.manual_seed(1)
    x, y = torch.randn(7, 4), torch.randn(7, 3)
    with torch.no_grad():
        parts = [model(xp) for xp in x.tensor_split(3)]
        want = sum(len(yp) / 7 * aux_loss(o, yp) for o, yp in zip(parts, y.tensor_split(3), strict=True))
    result = run_ranks(scalar_outputs, 2)[1]
    assert abs(result["evaluated"] - float(want)) < 1e-6  # type: ignore[operator]
    hidden, aux = result["predicted"]  # type: ignore[misc]
    torch.testing.assert_close(hidden, torch.cat([o[0] for o in parts]))
    torch.testing.assert_close(aux, torch.stack([o[1] for o in parts]))
    small_hidden, small_aux = result["small"]  # type: ignore[misc]
    with torch.no_grad():
        torch.testing.assert_close(small_hidden, model(x[:2])[0])
        torch.testing.assert_close(small_aux, torch.stack([model(x[i : i + 1])[1] for i in range(2)]))
    refused = result["refused"]
    assert isinstance(refused, list) and len(refused) == 2
    assert refused[0].startswith("a payload between stages must be a tensor or a non-empty tuple of tensors, got dict")
    assert "got ['Tensor', 'NoneType']" in refused[1]


def threads() -> int:
    return len(os.listdir("/proc/self/task"))


def first_target(out: torch.Tensor, targets: tuple[torch.Tensor, ...]) -> torch.Tensor:
    return mse(out, targets[0])


def pipelines_closed() -> dict[str, object]:
    torch.set_num_threads(1)
    mesh = init_mesh(2, timeout=3)
    counts = []
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    for own_mesh in (False, False, True, True):  # a mesh passed in, then one each pipeline makes itself
        with Pipeline(model, Partition.from_bounds((0, 1, 2)), n_microbatches=2, loss_fn=first_target,
                      mesh=None if own_mesh else mesh) as pipe:  # fmt: skip
            pipe.step(torch.randn(4, 4), [torch.randn(4, 2)])  # a list of tensors is taken as a tuple
        pipe.close()  # again: nothing happens
        counts.append(threads())
    try:
        pipe.step(torch.randn(4, 4), torch.randn(4, 2))
        after = "stepped"
    except RuntimeError as err:
        after = str(err)
    failing = lambda out, target: torch.tensor(float("nan")) if dist.get_rank() == 1 else mse(out, target)  # noqa: E731
    try:  # the block's own error comes out, not one from waiting for the sends it left behind
        with Pipeline(model, Partition.from_bounds((0, 1, 2)), n_microbatches=2, loss_fn=failing,
                      mesh=mesh) as pipe:  # fmt: skip
            pipe.step(torch.randn(4, 4), torch.randn(4, 2))
        raised = "nothing"
    except Exception as err:
        raised = type(err).__name__
    counts.append(threads())
    dist.destroy_process_group()
    return {"threads": counts, "after": after, "raised": raised}


def test_a_closed_pipeline_lets_go_of_its_process_groups() -> None:
    # Each Pipeline made process groups (with gloo's threads and sockets) that nothing destroyed: a job that
    # built pipelines in a loop gained about 3 threads and 5 descriptors per pipeline.
    results = run_ranks(pipelines_closed, 2)
    for result in results.values():
        counts = result["threads"]
        # Nothing grows from one pipeline to the next, whether the mesh was passed in or made by each pipeline
        # (gloo lets go of a destroyed group's threads a little later, hence not counts[2] == counts[1]).
        assert isinstance(counts, list) and counts[1] == counts[0] and counts[3] == counts[2], counts
        assert counts[4] <= counts[2], counts
        assert (
            result["after"] == "this Pipeline is closed (by close() or at the end of its with block); build a new one"
        )
    assert results[1]["raised"] == "NonFiniteLossError"


class Uninitialisable(torch.nn.Module):
    """A meta-device layer with a parameter that no reset_parameters() covers: materialising it is refused."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = torch.nn.Parameter(torch.empty(4, device="meta"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale


def failed_constructions() -> dict[str, object]:
    torch.set_num_threads(1)
    init_mesh(2)
    counts, errors = [], []
    for _ in range(4):  # each builds its own mesh, then fails materialising its stage
        try:
            Pipeline(torch.nn.Sequential(Uninitialisable(), Uninitialisable()), Partition.from_bounds((0, 1, 2)),
                     n_microbatches=2, loss_fn=mse)  # fmt: skip
        except TypeError as err:
            errors.append(str(err))
        counts.append(threads())
    dist.destroy_process_group()
    return {"threads": counts, "errors": errors}


def test_a_pipeline_that_fails_to_build_closes_the_groups_it_made() -> None:
    # A Pipeline that made its own mesh and then failed (here: a meta parameter it cannot initialise) left the
    # mesh's process groups, with gloo's threads, open for the rest of the process.
    for result in run_ranks(failed_constructions, 2).values():
        errors = result["errors"]
        assert isinstance(errors, list) and len(errors) == 4 and "reset_parameters" in errors[0], errors
        counts = result["threads"]
        assert isinstance(counts, list) and counts[3] == counts[2] == counts[1], counts  # gloo lets go a bit later


def misc(tmp: str) -> dict[str, object]:
    torch.set_num_threads(1)
    mesh = init_mesh(2, timeout=30)
    chain = Chain(("linear", "residual", "norm", "linear"), seed=5)
    out: dict[str, object] = {}
    x, y = chain.batch(7, 0)
    # Activation checkpointing recomputes but gives the same gradients.
    pipe = Pipeline(
        chain.build(),
        Partition.from_bounds((0, 2, 4)),
        n_microbatches=3,
        loss_fn=mse,
        mesh=mesh,
        options=PipelineOptions(
            compute=Compute(activation_checkpointing=True),
            diagnostics=Diagnostics(chrome_trace=Path(tmp) / "trace.json"),
        ),
    )
    out["loss"] = pipe.step(x, y).item()
    out["grads"] = {n: p.grad.clone() for n, p in pipe.named_parameters()}
    # A custom schedule from its text form.
    text = build("1f1b", 2, 3).to_text()
    custom = Pipeline(
        chain.build(),
        Partition.from_bounds((0, 2, 4)),
        schedule=Schedule.from_text(text),
        n_microbatches=3,
        loss_fn=mse,
        mesh=mesh,
    )
    out["custom_loss"] = custom.step(x, y).item()
    # Refused on both ranks before anything is sent.
    errors = {}
    try:
        Pipeline(chain.build(), Partition.from_bounds((0, 2, 4)), n_microbatches=9, loss_fn=mse, mesh=mesh).step(x, y)
    except ValueError as err:
        errors["too_many_microbatches"] = str(err)
    out["errors"] = errors
    dist.destroy_process_group()
    return out


def test_checkpointing_custom_schedules_traces_and_refusals(tmp_path: Path) -> None:
    results = run_ranks(misc, 2, str(tmp_path))
    chain = Chain(("linear", "residual", "norm", "linear"), seed=5)
    want = reference(chain, 7, 1)
    assert results[0]["loss"] == pytest.approx(want["losses"][0], abs=1e-5)  # type: ignore[index]
    assert results[1]["custom_loss"] == pytest.approx(want["losses"][0], abs=1e-5)  # type: ignore[index]
    grads = {**results[0]["grads"], **results[1]["grads"]}  # type: ignore[dict-item]
    for name, grad in want["grads"].items():  # type: ignore[attr-defined]
        torch.testing.assert_close(grads[name], grad, atol=1e-5, rtol=1e-5)
    for rank in (0, 1):
        trace = json.loads((tmp_path / f"trace.rank{rank}.json").read_text())["traceEvents"]
        names = {e["name"] for e in trace if e["ph"] == "X"}
        assert {f"{rank}F0", f"{rank}B2"} <= names
        assert any(e.get("cat") == "wait" for e in trace)
    assert "n_microbatches=9 is more than the batch of 7 inputs" in results[0]["errors"]["too_many_microbatches"]  # type: ignore[index]
    assert "n_microbatches=9 is more than the batch of 7 targets" in results[1]["errors"]["too_many_microbatches"]  # type: ignore[index]


CROSSED = """rank 0: 0F0 0F1 2F0 2F1 2B0 0F2 0F3 2B1 2F2 0B0 2F3 0B1 2B2 2B3 0B2 0B3
rank 1: 1F0 1F1 3F0 3B0 3F1 3B1 1F2 1B0 1F3 1B1 3F2 3B2 3F3 3B3 1B2 1B3"""
"""Interleaved on 2 ranks, rank 0 sending micro-batch 0's gradient (2B0) before micro-batch 2's activation (0F2),
which rank 1 receives first: both streams run from rank 0 to rank 1, each in its own order."""


def crossed_streams() -> dict[str, object]:
    torch.set_num_threads(1)
    chain = Chain(("linear", "residual", "norm", "linear", "gelu", "linear"), seed=8)
    x, y = chain.batch(8, 0)
    pipe = Pipeline(chain.build(), Partition.from_bounds((0, 2, 3, 5, 6)), schedule=Schedule.from_text(CROSSED),
                    n_microbatches=4, loss_fn=mse, mesh=init_mesh(2, timeout=30))  # fmt: skip
    loss = pipe.step(x, y).item()
    grads = {n: p.grad.clone() for n, p in pipe.named_parameters() if p.grad is not None}
    dist.destroy_process_group()
    return {"loss": loss, "grads": grads}


def test_a_schedule_whose_streams_cross_between_two_ranks_runs_and_equals_the_unsplit_model() -> None:
    validate(Schedule.from_text(CROSSED))  # only the order within each stream matters
    chain = Chain(("linear", "residual", "norm", "linear", "gelu", "linear"), seed=8)
    want = reference(chain, 8, 1)
    results = run_ranks(crossed_streams, 2)
    assert results[0]["loss"] == pytest.approx(want["losses"][0], abs=1e-5)  # type: ignore[index]
    grads = {**results[0]["grads"], **results[1]["grads"]}  # type: ignore[dict-item]
    assert grads.keys() == want["grads"].keys()  # type: ignore[attr-defined]
    for name, grad in want["grads"].items():  # type: ignore[attr-defined]
        torch.testing.assert_close(grads[name], grad, atol=1e-5, rtol=1e-5, msg=name)


def last_stage_refuses(case: str) -> str:
    """The last stage refuses; the first, waiting for its gradient, times out and says for what."""
    torch.set_num_threads(1)
    mesh = init_mesh(2, timeout=3)
    chain = Chain(("linear", "linear"), seed=1)
    loss_fn = (lambda o, t: (o - t) ** 2) if case == "non_scalar_loss" else mse
    pipe = Pipeline(chain.build(), Partition.from_bounds((0, 1, 2)), n_microbatches=2, loss_fn=loss_fn, mesh=mesh)
    x, y = chain.batch(4, 0)
    try:
        pipe.step(x, None if case == "missing_targets" and dist.get_rank() == 1 else y)
    except (ValueError, RuntimeError) as err:
        return f"{type(err).__name__}: {err}"
    return "no error"


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("non_scalar_loss", "ValueError: loss_fn must return a scalar tensor, got shape (2, 8)"),
        ("missing_targets", "ValueError: rank 1 holds the last stage and needs the targets to compute the loss"),
    ],
)
def test_the_last_stage_refuses_bad_losses_and_missing_targets(case: str, message: str) -> None:
    results = run_ranks(last_stage_refuses, 2, case, timeout=60)
    assert results[1].startswith(message)
    assert results[0].startswith("CommTimeoutError: rank 0 timed out after 3 s waiting for the gradient")


def stalled(seconds: float, where: str) -> str:
    torch.set_num_threads(1)
    if where == "loss over gloo":  # the transport's gloo group: the loss is a broadcast over the pipeline's
        os.environ["STAGEWISE_SHARED_MEMORY"] = "0"
    mesh = init_mesh(2, timeout=2)
    chain = Chain(("linear", "linear"), seed=1)
    pipe = Pipeline(chain.build(), Partition.from_bounds((0, 1, 2)), n_microbatches=2, loss_fn=mse, mesh=mesh)
    if dist.get_rank() == 1:  # alive, but stuck somewhere else: before its step, or before it tells rank 0 the loss
        if where == "step":
            time.sleep(seconds)
        else:
            share = pipe._share_loss

            def late_share(*args: Any, **kwargs: Any) -> torch.Tensor:
                time.sleep(seconds)
                return share(*args, **kwargs)

            pipe._share_loss = late_share  # type: ignore[method-assign]
    x, y = chain.batch(4, 0)
    pipe.step(x, y)
    return "finished"


@pytest.mark.parametrize(
    ("where", "awaited"),
    [
        ("step", "the gradient of micro-batch 0 for 0B0 (stage 0)"),
        ("loss", "the loss from rank 1, the last stage's, sent along the pipeline"),
        ("loss over gloo", "the loss from rank 1, the last stage's, sent along the pipeline"),
    ],
)
def test_a_stalled_peer_gives_a_named_error_not_a_hang(where: str, awaited: str) -> None:
    start = time.perf_counter()
    with pytest.raises(LaunchError) as info:
        run_ranks(stalled, 2, 40.0, where, timeout=90)
    # The stalled rank sleeps 40 s: the job ended long before, when its peer's 2 s wait ran out (on a loaded
    # machine, starting the processes alone took 15 s).
    assert time.perf_counter() - start < 40
    failure = info.value.failures[0]
    assert failure.rank == 0
    assert failure.message.startswith(f"CommTimeoutError: rank 0 timed out after 2 s waiting for {awaited}")


def test_refusals_before_any_process_group(monkeypatch: pytest.MonkeyPatch) -> None:
    chain = Chain(("linear", "linear"))
    with pytest.raises(ValueError, match=r"the partition splits 3 layers but the model has 2"):
        Pipeline(chain.build(), Partition.from_bounds((0, 1, 3)), n_microbatches=2, loss_fn=mse)
    with pytest.raises(TypeError, match=r"partition must be a stagewise Partition, got tuple"):
        Pipeline(chain.build(), (0, 1, 2), n_microbatches=2, loss_fn=mse)  # type: ignore[arg-type]
    with pytest.raises(
        ValueError,
        match=r"the schedule is for 2 stages and 3 micro-batches, but the partition has 2 stages and "
        r"n_microbatches is 2",
    ):
        Pipeline(
            chain.build(), Partition.from_bounds((0, 1, 2)), schedule=build("1f1b", 2, 3), n_microbatches=2, loss_fn=mse
        )
    with pytest.raises(
        ValueError,
        match=r"^PipelineOptions.n_virtual=1, but the schedule given has 2 stages per rank; leave n_virtual out",
    ):
        Pipeline(
            chain.build(), Partition.from_bounds((0, 1, 2)), schedule=build("interleaved-1f1b", 2, 2, n_virtual=2),
            n_microbatches=2, loss_fn=mse, options=PipelineOptions(n_virtual=1),
        )  # fmt: skip
    for none in ("fuse_weight_gradients", "data_parallel", "fully_sharded"):
        with pytest.raises(TypeError, match=rf"^PipelineOptions.{none} must be .*, got (None|NoneType); "):
            PipelineOptions(**{none: None})
    with pytest.raises(TypeError, match=r"fuse_weight_gradients must be a WeightGradientFusion, got 0; "):
        Pipeline(
            chain.build(), Partition.from_bounds((0, 1, 2)), n_microbatches=2, loss_fn=mse,
            options=PipelineOptions(fuse_weight_gradients=0),  # type: ignore[arg-type]
        )  # fmt: skip
    bad_values = (("min_elements", True), ("min_pooled_elements", -1), ("pool", 0), ("pool", 1.5), ("pool", "all"))
    for field, bad in bad_values:
        with pytest.raises(ValueError, match=rf"WeightGradientFusion.{field} must be a number of .* got {bad!r}"):
            WeightGradientFusion(**{field: bad})
    assert len(layers_of(chain.build())) == 2
