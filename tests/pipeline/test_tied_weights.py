"""Tied embedding and LM head on different stages train exactly as the unsplit tied model."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from support.late import comm_error, late
from support.multiproc import run_ranks

from stagewise.comm import init_mesh
from stagewise.models import GPT, GPTConfig
from stagewise.partition import Partition
from stagewise.pipeline import DataParallel, Pipeline, PipelineOptions, materialise_model
from stagewise.pipeline.parallel import tied_weights

STEPS = 3
CONFIG = GPTConfig(vocab_size=32, seq_len=8, d_model=16, n_layers=3, n_heads=2, tie_embeddings=True)
TIED = ("embed.tokens.weight", "head.weight")


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def batches(size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    ids = [torch.randint(0, CONFIG.vocab_size, (size, CONFIG.seq_len + 1), generator=g) for _ in range(STEPS)]
    return [(i[:, :-1], i[:, 1:]) for i in ids]


def unsplit(size: int, clip: float | None) -> dict[str, Any]:
    model = materialise_model(GPT(CONFIG, device="meta"), seed=5)
    assert model.head.weight is model.embed.tokens.weight  # the tie survives materialisation
    opt = torch.optim.SGD(model.parameters(), lr=0.2)  # Adam would amplify rounding in zero-gradient biases
    losses, norms = [], []
    for x, y in batches(size):
        opt.zero_grad()
        loss = lm_loss(model(x), y)
        loss.backward()
        losses.append(loss.item())
        if clip is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        opt.step()
    return {"losses": losses, "norms": norms, "params": model.state_dict()}


def train_tied(schedule: str, bounds: tuple[int, ...], pp: int, dp: int, clip: float | None) -> dict[str, Any]:
    torch.set_num_threads(1)
    mesh = init_mesh(pp, dp, timeout=30)
    model = GPT(CONFIG, device="meta")
    pipe = Pipeline(
        model,
        Partition.from_bounds(bounds),
        schedule=schedule,  # type: ignore[arg-type]
        n_microbatches=2,
        loss_fn=lm_loss,
        mesh=mesh,
        options=PipelineOptions(seed=5),
    )
    opt = torch.optim.SGD(pipe.parameters(), lr=0.2)
    losses, norms = [], []
    for x, y in batches(4 * dp):
        share = slice(4 * mesh.replica, 4 * mesh.replica + 4)
        opt.zero_grad()
        losses.append(pipe.step(x[share], y[share]).item())
        if clip is not None:
            norms.append(float(pipe.clip_grad_norm_(clip)))
        opt.step()
    dist.destroy_process_group()
    return {"losses": losses, "norms": norms, "params": pipe.state_dict()}


def check(results: dict[int, dict[str, Any]], want: dict[str, Any]) -> None:
    merged: dict[str, torch.Tensor] = {}
    for got in results.values():
        torch.testing.assert_close(got["losses"], want["losses"], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got["norms"], want["norms"], atol=1e-5, rtol=1e-5)
        for name, value in got["params"].items():
            if name in merged:  # the other stage's copy of the tied weight: still equal after training
                torch.testing.assert_close(value, merged[name], atol=0, rtol=0)
            merged[name] = value
    assert set(merged) == set(want["params"])
    for name, value in want["params"].items():
        torch.testing.assert_close(merged[name], value, atol=1e-5, rtol=1e-5, msg=name)
    assert all(n in results[0]["params"] for n in TIED[:1]) and TIED[1] in results[max(results)]["params"]


def test_tied_embedding_and_head_on_two_stages_equal_the_unsplit_model() -> None:
    want = unsplit(4, clip=0.5)
    for schedule in ("1f1b", "zero-bubble"):
        check(run_ranks(train_tied, 2, schedule, (0, 2, 6), 2, 1, 0.5, timeout=120), want)


def test_tied_weights_with_two_replicas() -> None:
    check(run_ranks(train_tied, 4, "gpipe", (0, 3, 6), 2, 2, None, timeout=120), unsplit(8, clip=None))


def accumulate_tied(dp: int) -> dict[str, torch.Tensor]:
    """Two steps without zeroing the gradients in between: each copy must hold the sum of both steps'.

    With replicas, DDP's gradients are views of its buckets, which it overwrites at every step."""
    torch.set_num_threads(1)
    mesh = init_mesh(2, dp, timeout=30)
    ddp = DataParallel(gradient_as_bucket_view=True)
    pipe = Pipeline(GPT(CONFIG, device="meta"), Partition.from_bounds((0, 2, 6)), n_microbatches=2, loss_fn=lm_loss,
                    mesh=mesh, options=PipelineOptions(seed=5, data_parallel=ddp))  # fmt: skip
    for x, y in batches(4 * dp)[:2]:
        share = slice(4 * mesh.replica, 4 * mesh.replica + 4)
        pipe.step(x[share], y[share])
    grads = {name: p.grad.clone() for name, p in pipe.named_parameters() if p.grad is not None}
    dist.destroy_process_group()
    return grads


@pytest.mark.parametrize("dp", [1, 2])
def test_tied_gradients_accumulate_over_steps_like_the_unsplit_model(dp: int) -> None:
    model = materialise_model(GPT(CONFIG, device="meta"), seed=5)
    for x, y in batches(4 * dp)[:2]:
        lm_loss(model(x), y).backward()
    want = {name: p.grad for name, p in model.named_parameters()}
    results = run_ranks(accumulate_tied, 2 * dp, dp)
    assert TIED[0] in results[0] and TIED[1] in results[2 * dp - 1]
    for got in results.values():
        for name, grad in got.items():
            torch.testing.assert_close(grad, want[TIED[0] if name in TIED else name], atol=1e-5, rtol=1e-5, msg=name)


def stalled_tie(seconds: float) -> str:
    """Rank 1 reaches the sum of the tied copies' gradients ``seconds`` late; rank 0 must time out, naming it."""
    torch.set_num_threads(1)
    mesh = init_mesh(2, timeout=3)
    pipe = Pipeline(GPT(CONFIG, device="meta"), Partition.from_bounds((0, 2, 6)), n_microbatches=2, loss_fn=lm_loss,
                    mesh=mesh, options=PipelineOptions(seed=5))  # fmt: skip
    if mesh.rank == 1:
        ties = pipe._runtime.ties
        ties.sum_gradients = late(ties.sum_gradients, seconds)  # type: ignore[method-assign]
    x, y = batches(4)[0]
    return comm_error(lambda: pipe.step(x, y))


def test_a_late_tied_copy_gives_a_named_timeout() -> None:
    started = time.monotonic()
    messages = run_ranks(stalled_tie, 2, 4.5, timeout=90)
    assert messages[0].startswith("CommTimeoutError: rank 0 timed out after 3 s in the sum of the gradients of tied ")
    assert time.monotonic() - started < 60


def late_to_synchronise(seconds: float) -> str:
    """Rank 1 reaches the broadcast of the tied copies' initial value ``seconds`` late."""
    torch.set_num_threads(1)
    mesh = init_mesh(2, timeout=3)
    if mesh.rank == 1:
        tied_weights.Ties.synchronise = late(tied_weights.Ties.synchronise, seconds)  # type: ignore[method-assign]
    part = Partition.from_bounds((0, 2, 6))
    model = GPT(CONFIG, device="meta")
    return comm_error(
        lambda: Pipeline(model, part, n_microbatches=2, loss_fn=lm_loss, mesh=mesh, options=PipelineOptions(seed=5))
    )


def test_a_copy_late_to_its_initial_value_gives_a_named_timeout() -> None:
    # The broadcast that gives every copy the first user's value timed out with gloo's bare RuntimeError.
    messages = run_ranks(late_to_synchronise, 2, 4.5, timeout=90)
    assert messages[0].startswith(
        "CommTimeoutError: rank 0 timed out after 3 s in the broadcast of tied parameter 'embed.tokens.weight'"
    ), messages


def frozen_tie() -> list[bool]:
    torch.set_num_threads(1)
    model = GPT(CONFIG, device="meta")
    model.embed.tokens.weight.requires_grad_(False)  # the tied embedding and head, frozen
    pipe = Pipeline(model, Partition.from_bounds((0, 2, 6)), n_microbatches=2, loss_fn=lm_loss,
                    mesh=init_mesh(2, timeout=30), options=PipelineOptions(seed=5))  # fmt: skip
    x, y = batches(4)[0]
    pipe.step(x, y)
    got = [p.grad is None for name, p in pipe.named_parameters() if name in TIED]
    dist.destroy_process_group()
    return got


def test_a_frozen_tied_weight_gets_no_gradient_on_any_copy() -> None:
    # A zero gradient would not do: weight decay would then move the frozen weight.
    assert run_ranks(frozen_tie, 2) == {0: [True], 1: [True]}
