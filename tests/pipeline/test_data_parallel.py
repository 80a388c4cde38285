"""Pipeline x data parallel: DDP per stage equals the unsplit model on the global batch, synchronising once per step."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
import torch.distributed as dist
from support.cases import Case
from support.chains import Chain, mse
from support.late import comm_error, late
from support.multiproc import run_ranks
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import Dataset

from stagewise.comm import CommError, LaunchError, PipelineMesh, init_mesh
from stagewise.partition import Partition
from stagewise.pipeline import (
    DataParallel,
    LoaderOptions,
    Loss,
    Pipeline,
    PipelineOptions,
    StageLoader,
    WeightGradientFusion,
)
from stagewise.pipeline.loss import sharing as loss_sharing

STEPS = 3
CLIP = 0.3  # small enough to clip at every step


class ChainData(Dataset[tuple[Any, torch.Tensor]]):
    """Random (inputs, targets) samples for a chain, fixed by its seed."""

    def __init__(self, chain: Chain, n: int) -> None:
        g = torch.Generator().manual_seed(chain.seed)
        self.x = torch.randn(n, chain.width, generator=g)
        self.y = torch.randn(n, chain.width, generator=g)
        self.ids = torch.randint(0, 10, (n,), generator=g)
        self.with_ids = chain.with_ids

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[Any, torch.Tensor]:
        return ((self.x[i], self.ids[i]) if self.with_ids else self.x[i]), self.y[i]


def loaders(case: Case, dp: int) -> list[StageLoader]:
    data = ChainData(case.chain, STEPS * case.global_batch)
    return [
        StageLoader(
            data,
            global_batch_size=case.global_batch,
            dp=dp,
            replica=r,
            first=True,
            last=True,
            options=LoaderOptions(seed=7),
        )
        for r in range(dp)
    ]


def global_batches(case: Case, dp: int) -> list[tuple[Any, torch.Tensor]]:
    """Each step's global batch: the replicas' batches, concatenated in replica order."""
    per_replica = [list(one) for one in loaders(case, dp)]
    out = []
    for step in range(STEPS):
        parts = [per_replica[r][step] for r in range(dp)]
        ys = torch.cat([p.targets for p in parts])  # type: ignore[misc]
        if case.chain.with_ids:
            xs: Any = tuple(torch.cat([p.inputs[i] for p in parts]) for i in range(2))  # type: ignore[index]
        else:
            xs = torch.cat([p.inputs for p in parts])  # type: ignore[misc]
        out.append((xs, ys))
    return out


def unsplit(case: Case, dp: int) -> dict[str, Any]:
    """One process, the whole model, the global batches: the reference."""
    model = case.chain.build()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses, norms, grads = [], [], {}
    for step, (x, y) in enumerate(global_batches(case, dp)):
        opt.zero_grad()
        loss = case.loss(model(x), y)
        loss.backward()
        losses.append(loss.item())
        if step == 0:
            grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        if case.clip:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
    return {"losses": losses, "norms": norms, "grads": grads, "params": dict(model.named_parameters())}


CALLS: list[int] = []


def counting_hook(group, bucket):  # type: ignore[no-untyped-def]  # DDP checks real (not string) annotations
    """torch's all-reduce hook, counting each bucket it reduces."""
    CALLS.append(bucket.index())
    return default_hooks.allreduce_hook(group, bucket)


def train_hybrid(cases: list[Case], pp: int, dp: int) -> list[dict[str, Any]]:
    torch.set_num_threads(1)
    mesh = init_mesh(pp, dp, timeout=30)
    results = []
    for case in cases:
        pipe = Pipeline(
            case.chain.build(),
            Partition.from_bounds(case.bounds),
            schedule=case.schedule,  # type: ignore[arg-type]
            n_microbatches=case.n_microbatches,
            loss_fn=case.loss,
            # type: ignore[arg-type]
            mesh=mesh,
            # one bucket per stage
            # DDP's hooks must still see each stage's last backward, and pooled gradients be flushed before it
            options=PipelineOptions(
                n_virtual=case.n_virtual,
                loss=Loss(reduction=case.reduction),
                data_parallel=DataParallel(bucket_cap_mb=1000, comm_hook=counting_hook),
                fuse_weight_gradients=WeightGradientFusion.every(pool=2),
            ),
        )
        data = ChainData(case.chain, STEPS * case.global_batch)
        loader = StageLoader.of(pipe, data, global_batch_size=case.global_batch, options=LoaderOptions(seed=7))
        opt = torch.optim.SGD(pipe.parameters(), lr=0.05)
        losses, norms, calls, grads = [], [], [], {}
        for step, batch in enumerate(loader):
            opt.zero_grad()
            CALLS.clear()
            losses.append(pipe.step(batch.inputs, batch.targets).item())
            calls.append(len(CALLS))
            if step == 0:
                grads = {n: p.grad.clone() for n, p in pipe.named_parameters() if p.grad is not None}
            if case.clip:
                norms.append(float(pipe.clip_grad_norm_(CLIP)))
            opt.step()
        stages_with_params = sum(1 for s in pipe.stages.values() if any(True for _ in s.parameters()))
        params = {n: p.detach().clone() for n, p in pipe.named_parameters()}
        result = {"losses": losses, "norms": norms, "calls": calls, "grads": grads, "params": params}
        results.append(result | {"synced": stages_with_params})
    dist.destroy_process_group()
    return results


def check(cases: list[Case], pp: int, dp: int) -> None:
    per_rank = run_ranks(train_hybrid, pp * dp, cases, pp, dp, timeout=240)
    for i, case in enumerate(cases):
        want = unsplit(case, dp)
        for rank, results in per_rank.items():
            got = results[i]
            torch.testing.assert_close(got["losses"], want["losses"], atol=1e-5, rtol=1e-5, msg=f"rank {rank} {case}")
            torch.testing.assert_close(got["norms"], want["norms"], atol=1e-5, rtol=1e-5, msg=f"rank {rank} {case}")
            # DDP all-reduced each stage's gradients exactly once per step, whatever the micro-batch count.
            assert got["calls"] == [got["synced"]] * STEPS, (rank, case)
            for name, grad in got["grads"].items():
                torch.testing.assert_close(grad, want["grads"][name], atol=1e-5, rtol=1e-5, msg=f"{name} {case}")
            for name, param in got["params"].items():
                torch.testing.assert_close(param, want["params"][name], atol=1e-5, rtol=1e-5, msg=f"{name} {case}")
        held = {name for results in per_rank.values() for name in results[i]["params"]}
        assert held == set(want["params"]), case  # together the ranks hold the whole model


CHAIN = Chain(("linear", "residual", "norm", "gelu", "linear", "residual"), with_ids=True, seed=11)


def test_pipeline_of_two_by_two_replicas_equals_the_unsplit_model() -> None:
    cases = [
        Case(CHAIN, (0, 3, 8), "1f1b", 1, 3, 14, clip=True),
        Case(CHAIN, (0, 5, 8), "gpipe", 1, 4, 16, clip=False),
        Case(CHAIN, (0, 2, 8), "zero-bubble", 1, 3, 12, clip=True),
        Case(CHAIN, (0, 2, 4, 6, 8), "interleaved-1f1b", 2, 2, 10, clip=True),
        Case(CHAIN, (0, 4, 8), "1f1b", 1, 1, 6, clip=False),
        Case(CHAIN, (0, 6, 8), "gpipe", 1, 2, 8, clip=True, reduction="sum"),
        Case(Chain(("twice", "norm", "twice"), seed=12), (0, 2, 3), "zero-bubble", 1, 3, 12, clip=False),
    ]
    check(cases, pp=2, dp=2)


def ddp_against_pipeline(case: Case) -> dict[str, Any]:
    """pp=1 x dp=2: stagewise's Pipeline and plain DDP on the whole model, in the same processes."""
    torch.set_num_threads(1)
    mesh = init_mesh(1, 2, timeout=60)
    part = Partition.from_bounds(case.bounds)
    pipe = Pipeline(case.chain.build(), part, n_microbatches=case.n_microbatches, loss_fn=mse, mesh=mesh)
    plain = DistributedDataParallel(case.chain.build())
    data = ChainData(case.chain, STEPS * case.global_batch)
    loader = StageLoader.of(pipe, data, global_batch_size=case.global_batch, options=LoaderOptions(seed=7))
    opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (pipe, plain)]
    worst_grad = 0.0
    for batch in loader:
        for opt in opts:
            opt.zero_grad()
        pipe.step(batch.inputs, batch.targets)
        mse(plain(batch.inputs), batch.targets).backward()
        ours = dict(pipe.named_parameters())
        for name, p in plain.module.named_parameters():
            worst_grad = max(worst_grad, float((ours[name].grad - p.grad).abs().max()))  # type: ignore[operator]
        for opt in opts:
            opt.step()
    ours = dict(pipe.named_parameters())
    worst_param = max(float((ours[n] - p).abs().max()) for n, p in plain.module.named_parameters())
    dist.destroy_process_group()
    return {"grad": worst_grad, "param": worst_param, "params": {n: p.detach().clone() for n, p in ours.items()}}


def test_one_stage_two_replicas_equals_plain_ddp() -> None:
    case = Case(CHAIN, (0, 8), "1f1b", 1, 3, 10, clip=False)
    results = run_ranks(ddp_against_pipeline, 2, case, timeout=120)
    want = unsplit(case, 2)
    for rank, got in results.items():
        assert got["grad"] < 1e-5 and got["param"] < 1e-5, (rank, got["grad"], got["param"])
        for name, param in got["params"].items():
            torch.testing.assert_close(param, want["params"][name], atol=1e-5, rtol=1e-5, msg=name)


def uneven_replicas() -> None:
    torch.set_num_threads(1)
    mesh = init_mesh(1, 2, timeout=60)
    part = Partition.from_bounds((0, 1))
    pipe = Pipeline(nn.Sequential(nn.Linear(4, 4)), part, n_microbatches=2, loss_fn=mse, mesh=mesh)
    size = 4 + 2 * mesh.replica
    pipe.step(torch.randn(size, 4), torch.randn(size, 4))


def test_replicas_with_different_batch_sizes_are_refused() -> None:
    try:
        run_ranks(uneven_replicas, 2, timeout=120)
    except LaunchError as err:
        messages = [f.message for f in err.failures]
        assert any("the replicas' batches differ in size (4 to 6 samples)" in m for m in messages), messages
    else:
        raise AssertionError("uneven replica batches trained without an error")


def evaluate_uneven_replicas() -> tuple[float, float, str]:
    torch.set_num_threads(1)
    mesh = init_mesh(1, 2, timeout=60)
    torch.manual_seed(0)
    pipe = Pipeline(nn.Sequential(nn.Linear(4, 4)), Partition.from_bounds((0, 1)), n_microbatches=2, loss_fn=mse,
                    mesh=mesh)  # fmt: skip
    x, y = torch.randn(10, 4), torch.randn(10, 4)
    rows = slice(0, 4) if mesh.replica == 0 else slice(4, 10)  # a last batch split 4 + 6
    loss = float(pipe.evaluate(x[rows], y[rows]))
    rows = slice(0, 4) if mesh.replica == 0 else slice(4, 5)  # a last batch of 5 split 4 + 1, under 2 micro-batches
    small = float(pipe.evaluate(x[rows], y[rows]))
    try:
        pipe.evaluate(x[:8], y[:2])
        mismatch = "evaluated"
    except ValueError as err:
        mismatch = str(err)
    try:
        pipe.evaluate(x[:0], y[:0])
    except ValueError as err:
        mismatch += f" | {err}"
    dist.destroy_process_group()
    return loss, small, mismatch


def test_evaluation_takes_replica_batches_of_different_sizes() -> None:
    # Only a training step needs equal replica batches (DDP averages gradients with equal weights); evaluate
    # weights each replica's loss by its samples, and refused a last batch split unevenly with step's message.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4))
    x, y = torch.randn(10, 4), torch.randn(10, 4)
    with torch.no_grad():
        want = float(mse(model(x), y))
    with torch.no_grad():
        small = float(mse(model(x[:5]), y[:5]))
    for loss, smaller, mismatch in run_ranks(evaluate_uneven_replicas, 2).values():
        assert abs(loss - want) < 1e-5
        assert abs(smaller - small) < 1e-5
        assert mismatch == (
            "inputs (8 samples) and targets (2) differ in batch size | "
            "the inputs have no samples (a batch of 0); give at least one"
        )


def late_replica_loss(seconds: float) -> str:
    """Replica 1 reaches the all-gather of the losses ``seconds`` late; replica 0 must time out, naming it."""
    torch.set_num_threads(1)
    mesh = init_mesh(1, 2, timeout=3)
    pipe = Pipeline(nn.Sequential(nn.Linear(4, 4)), Partition.from_bounds((0, 1)), n_microbatches=2, loss_fn=mse,
                    mesh=mesh)  # fmt: skip
    if mesh.replica == 1:
        loss_sharing.combine_losses = late(loss_sharing.combine_losses, seconds)  # type: ignore[assignment]
    return comm_error(lambda: pipe.step(torch.randn(4, 4), torch.randn(4, 4)))


def test_a_late_replica_gives_a_named_timeout_in_the_loss_all_gather() -> None:
    started = time.monotonic()
    messages = run_ranks(late_replica_loss, 2, 4.5, timeout=90)
    assert messages[0].startswith("CommTimeoutError: rank 0 timed out after 3 s in the all-gather of the replicas' "), (
        messages
    )
    assert time.monotonic() - started < 60


class Gate(nn.Module):
    """Adds a linear of the rows whose first feature exceeds 4; other rows pass unchanged (row by row)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x[:, 0] > 4
        if not bool(rows.any()):
            return x
        out = x.clone()
        out[rows] = x[rows] + self.lin(x[rows])
        return out


def gated() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(Gate(6), nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 2))


def gated_batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(12, 6, generator=g), torch.randn(12, 2, generator=g)
    x[0, 0] = 5.0  # only replica 0's first micro-batch uses the gate's linear
    return x, y


def used_by_one_micro_batch(schedule: str) -> dict[str, torch.Tensor]:
    torch.set_num_threads(1)
    mesh = init_mesh(1, 2)
    pipe = Pipeline(
        gated(), Partition.from_bounds((0, 4)), schedule=schedule, n_microbatches=3, loss_fn=mse, mesh=mesh,
        options=PipelineOptions(fuse_weight_gradients=WeightGradientFusion.every(),
                                data_parallel=DataParallel(find_unused_parameters=True)),
    )  # fmt: skip
    x, y = gated_batch()
    r = mesh.replica
    pipe.step(x[6 * r : 6 * r + 6], y[6 * r : 6 * r + 6])
    grads = {name: p.grad.clone() for name, p in pipe.named_parameters() if p.grad is not None}
    dist.destroy_process_group()
    return grads


@pytest.mark.parametrize("schedule", ["gpipe", "zero-bubble"])
def test_find_unused_parameters_sees_a_parameter_one_early_micro_batch_used(schedule: str) -> None:
    # DDP learns which parameters a replica used from their gradient hooks; fused or pooled backwards skip
    # them, and the gate's weights, used in replica 0's first micro-batch only, were left out of the
    # all-reduce: replica 0 kept its own gradient and replica 1 had none.
    model = gated()
    x, y = gated_batch()
    mse(model(x), y).backward()
    for grads in run_ranks(used_by_one_micro_batch, 2, schedule).values():
        assert sorted(grads) == sorted(name for name, _ in model.named_parameters())
        for name, p in model.named_parameters():
            torch.testing.assert_close(grads[name], p.grad, atol=1e-5, rtol=1e-5, msg=name)


class AddPosition(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pos = nn.Parameter(torch.linspace(-1, 1, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x * 1.0
        x += self.pos  # in place, on an activation
        return x


def in_place_under_data_parallelism() -> str:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), AddPosition(), nn.Tanh(), nn.Linear(4, 2))
    pipe = Pipeline(model, Partition.from_bounds((0, 4)), schedule="zero-bubble", n_microbatches=2, loss_fn=mse,
                    mesh=init_mesh(1, 2, timeout=10))  # fmt: skip
    try:
        pipe.step(torch.randn(4, 4), torch.randn(4, 2))
    except Exception as err:
        return f"{type(err).__name__}: {err}"
    finally:
        dist.destroy_process_group()
    return "ran"


def test_zero_bubble_under_ddp_refuses_an_in_place_op_that_reads_a_parameter() -> None:
    # W under DDP stops at marks on every input of an op that reads a parameter; autograd cannot change such a
    # mark in place, and the step failed with its own message about views of custom Functions.
    for message in run_ranks(in_place_under_data_parallelism, 2).values():
        assert message.startswith("StageError: stage 0 (layers 0 .. 3) failed in the forward of micro-batch ")
        assert "an in-place add_ reads a parameter that W (zero-bubble's weight pass) must reach" in message
        assert message.endswith("write it out of place (x = x + self.pos, not x += self.pos)")


def replica_refuses_its_batch() -> str:
    torch.set_num_threads(1)
    mesh = init_mesh(1, 2, timeout=3)
    pipe = Pipeline(nn.Sequential(nn.Linear(4, 4)), Partition.from_bounds((0, 1)), n_microbatches=2, loss_fn=mse,
                    mesh=mesh)  # fmt: skip
    size = 4 if mesh.replica == 0 else 1  # replica 1 has fewer samples than micro-batches: refused at once
    try:
        pipe.step(torch.randn(size, 4), torch.randn(size, 4))
    except ValueError as err:
        time.sleep(4.5)  # stays alive past the timeout, as a job that logs the error and goes on would
        return f"ValueError: {err}"
    except CommError as err:
        return f"{type(err).__name__}: {err}"
    return "no error"


def test_a_replica_missing_from_ddps_all_reduce_gives_a_named_timeout() -> None:
    # DDP's all-reduce runs inside the step's last backward; it timed out with gloo's bare RuntimeError.
    messages = run_ranks(replica_refuses_its_batch, 2, timeout=60)
    assert messages[1].startswith("ValueError: n_microbatches=2 is more than the batch of 1 inputs")
    assert messages[0].startswith(
        "CommTimeoutError: rank 0 timed out after 3 s in DDP's all-reduce of stage 0's gradients over its replicas, "
        "in 0B1"
    )


class Scale(nn.Module):
    """Multiplies by a parameter that starts at one: the values pass unchanged, and now carry a gradient."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight


def gate_last(pp: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*([Scale(6)] if pp > 1 else []), Gate(6))


def gated_steps(model: nn.Module | Pipeline, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> list[dict[str, Any]]:
    """Two SGD steps; the gradients of each, by parameter name."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    grads = []
    for x, y in batches:
        opt.zero_grad()
        if isinstance(model, Pipeline):
            model.step(x, y)
        else:
            loss = mse(model(x), y)
            if loss.requires_grad:  # a batch that uses no parameter has no backward
                loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        opt.step()
    return grads


def gated_and_ungated() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Two steps on :func:`gated_batch`, then one that uses the gate's linear nowhere."""
    x, y = gated_batch()
    y = y.repeat(1, 3)
    off = x.clone()
    off[0, 0] = 0.0
    return [(x, y), (x, y), (off, y)]


def unused_by_the_synchronising_micro_batch(pp: int) -> dict[str, list[dict[str, Any]]]:
    torch.set_num_threads(1)
    mesh = init_mesh(pp, 2, timeout=30)
    r = mesh.replica
    out = {}
    for schedule in ("gpipe", "1f1b", "zero-bubble"):
        for unused in (True, False):
            pipe = Pipeline(gate_last(pp), Partition.from_bounds(tuple(range(pp + 1))), schedule=schedule,
                            n_microbatches=3, loss_fn=mse, mesh=mesh,
                            options=PipelineOptions(
                                data_parallel=DataParallel(find_unused_parameters=unused)))  # fmt: skip
            out[f"{schedule} {unused}"] = gated_steps(pipe, [(x[6 * r : 6 * r + 6], y[6 * r : 6 * r + 6])
                                                             for x, y in gated_and_ungated()])  # fmt: skip
    if pp == 1:
        out["agree"] = [replicas_agree(mesh)]
    dist.destroy_process_group()
    return out


class TwoBranches(nn.Module):
    """``lin_b`` on rows whose first feature is positive (all of them, or none), ``lin_a`` never."""

    def __init__(self) -> None:
        super().__init__()
        self.lin_a, self.lin_b = nn.Linear(2, 2), nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        data = x[:, 1:]
        return data + self.lin_b(data) if bool((x[:, 0] > 0).all()) else data


def replicas_agree(mesh: PipelineMesh) -> dict[str, bool]:
    """Replica 0 uses none of the stage's parameters, replica 1 only ``lin_b``: after two steps of SGD with
    momentum and weight decay, whether the replicas hold the same value of each parameter."""
    torch.manual_seed(0)
    pipe = Pipeline(nn.Sequential(TwoBranches()), Partition.from_bounds((0, 1)), n_microbatches=2, loss_fn=mse,
                    mesh=mesh,
                    options=PipelineOptions(data_parallel=DataParallel(find_unused_parameters=True)))  # fmt: skip
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(4, 3, generator=g), torch.randn(4, 2, generator=g)
    x[:, 0] = float(mesh.replica)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1, momentum=0.9, weight_decay=0.5)
    for _ in range(2):
        opt.zero_grad(set_to_none=True)
        pipe.step(x, y)
        opt.step()
    agree = {}
    for name, p in pipe.named_parameters():
        every = [torch.empty_like(p.data) for _ in range(2)]
        dist.all_gather(every, p.data.contiguous(), group=mesh.dp_group)
        agree[name] = torch.equal(every[0], every[1])
    return agree


@pytest.mark.parametrize("pp", [1, 2])
def test_replicas_synchronise_when_the_last_micro_batch_uses_none_of_a_stages_parameters(pp: int) -> None:
    # The gate's linear is used by replica 0's first micro-batch only. DDP all-reduces a stage's gradients in the
    # hooks of its last backward of the step, and here that backward reached none of the stage's parameters
    # (pp=1: nothing in it needed a gradient): no hook fired, and each replica kept its own gradients.
    # In the last step no replica uses the linear: the root that makes DDP synchronise reads it, and it gets a zero
    # gradient on every replica where the unsplit model has none. The replicas must agree whatever each one used: a
    # replica that turned its zero back into None while DDP gave the others zero drifted apart under weight decay.
    want = gated_steps(gate_last(pp), gated_and_ungated())
    for rank, results in run_ranks(unused_by_the_synchronising_micro_batch, 2 * pp, pp, timeout=180).items():
        if pp == 1:
            assert results.pop("agree") == [{"0.lin_a.weight": True, "0.lin_a.bias": True, "0.lin_b.weight": True,
                                             "0.lin_b.bias": True}]  # fmt: skip
        for case, got in results.items():
            for step, (mine, reference) in enumerate(zip(got, want, strict=True)):
                held = {n for n in reference if pp == 1 or n.startswith("0.") == (rank < 2)}  # rank r: stage r // 2
                assert held <= set(mine), (rank, case, step, sorted(mine))
                for name in mine:
                    if name not in reference:
                        assert not mine[name].any(), (rank, case, step, name)
                        continue
                    torch.testing.assert_close(
                        mine[name], reference[name], atol=1e-6, rtol=1e-5, msg=f"rank {rank} {case} step {step} {name}"
                    )
