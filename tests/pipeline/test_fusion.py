"""Fused weight-gradient accumulation gives autograd's gradients, and leaves alone what it must not touch."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import pytest
import torch
import torch.nn.functional as F
from support.chains import Chain
from torch import nn

from stagewise.partition import layers_of
from stagewise.pipeline import Compute, WeightGradientFusion
from stagewise.pipeline.backward.fusion import FusedWeightGradients, WeightGradientStore
from stagewise.pipeline.backward.plan import BackwardPlan
from stagewise.pipeline.backward.split import ParameterUses, WeightUse
from stagewise.pipeline.execution.executor import Executor
from stagewise.pipeline.loss.microbatch import split
from stagewise.pipeline.stage.module import StageModule
from stagewise.schedule import Schedule, ScheduleName, build, holdings, peak_in_flight, validate
from stagewise.schedule.actions import Action, Kind, forwards_first
from stagewise.schedule.holdings import Holding, free_pool


class TiedHead(nn.Module):
    """A linear layer, a functional linear reusing its weight, then the ATen linear op that traced graphs call."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(6, 6)
        self.out = nn.Linear(6, 3, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.proj(x))
        h = F.linear(h, self.proj.weight)  # the same weight again, without bias
        return torch.ops.aten.linear.default(h, self.out.weight)  # as a traced graph calls it


def _autograd_grads(model: nn.Module, batches: list[torch.Tensor]) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    for x in batches:
        model(x).square().sum().backward()
    return [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]


def test_micro_batches_accumulate_the_same_gradients_as_autograd() -> None:
    torch.manual_seed(0)
    model = TiedHead()
    batches = [torch.randn(4, 5, 6) for _ in range(3)]  # 3-D inputs, as a sequence model's
    want = _autograd_grads(model, batches)
    model.zero_grad(set_to_none=True)
    for x in batches:
        with FusedWeightGradients(model.parameters()):
            out = model(x)
        assert "AccumulatingLinear" in type(out.grad_fn).__name__  # the mode did take the linear ops
        out.square().sum().backward()
    for param, grad in zip(model.parameters(), want, strict=True):
        torch.testing.assert_close(param.grad, grad, atol=1e-5, rtol=1e-5)


def test_existing_gradients_are_added_to_and_inputs_get_theirs() -> None:
    torch.manual_seed(1)
    layer = nn.Linear(4, 2)
    x = torch.randn(3, 4, requires_grad=True)
    start = torch.randn(2, 4)
    layer.weight.grad = start.clone()
    with FusedWeightGradients(layer.parameters()):
        out = layer(x)
    out.sum().backward()
    x_plain = x.detach().clone().requires_grad_()
    plain = nn.Linear(4, 2)
    plain.load_state_dict(layer.state_dict())
    plain(x_plain).sum().backward()
    torch.testing.assert_close(layer.weight.grad, start + plain.weight.grad)
    torch.testing.assert_close(layer.bias.grad, plain.bias.grad)
    torch.testing.assert_close(x.grad, x_plain.grad)


def test_frozen_foreign_autocast_and_no_grad_linears_run_unchanged() -> None:
    layer, other = nn.Linear(4, 4), nn.Linear(4, 4)
    layer.bias.requires_grad_(False)
    x = torch.randn(2, 4)
    with FusedWeightGradients([layer.weight, layer.bias]):
        fused = layer(x)
        assert "AccumulatingLinear" in type(fused.grad_fn).__name__
        assert "AccumulatingLinear" not in type(other(x).grad_fn).__name__  # not one of the given parameters
        with torch.no_grad():
            assert layer(x).grad_fn is None
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert "AccumulatingLinear" not in type(layer(x).grad_fn).__name__
    fused.sum().backward()
    assert layer.weight.grad is not None and layer.bias.grad is None  # the frozen bias got nothing
    layer.weight.requires_grad_(False)
    with FusedWeightGradients([layer.weight]):
        assert layer(x).grad_fn is None  # nothing requires grad: nothing to fuse


class ScaledBias(nn.Module):
    """A linear whose bias is computed, ``gain * bias``: its gradient must reach both parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 4))
        self.bias = nn.Parameter(torch.randn(4))
        self.gain = nn.Parameter(torch.tensor(2.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.gain * self.bias)


def test_a_linear_with_a_computed_bias_runs_unchanged() -> None:
    torch.manual_seed(2)
    model = ScaledBias()
    x = torch.randn(3, 4)
    want = _autograd_grads(model, [x])
    model.zero_grad(set_to_none=True)
    with FusedWeightGradients(model.parameters()):
        out = model(x)
    assert "AccumulatingLinear" not in type(out.grad_fn).__name__
    out.square().sum().backward()
    for (name, param), grad in zip(model.named_parameters(), want, strict=True):
        torch.testing.assert_close(param.grad, grad, msg=name)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_a_fused_stage_equals_autograd_with_and_without_checkpointing(checkpointing: bool) -> None:
    chain = Chain(("linear", "residual", "norm", "gelu", "linear"), seed=4)
    x, _ = chain.batch(5, 0)
    batches = list(x.tensor_split(3))
    want = _autograd_grads(chain.build(), batches)
    stage = StageModule(
        0,
        0,
        layers_of(chain.build()),
        compute=Compute(activation_checkpointing=checkpointing),
        fusion=WeightGradientFusion.every(),
    )
    for part in batches:
        out = stage.run(part, BackwardPlan(fused=True))
        assert isinstance(out, torch.Tensor)
        out.square().sum().backward()
    for param, grad in zip(stage.parameters(), want, strict=True):
        torch.testing.assert_close(param.grad, grad, atol=1e-5, rtol=1e-5)


def test_a_store_defers_weight_gradients_to_one_gemm_per_weight() -> None:
    torch.manual_seed(2)
    model = TiedHead()
    batches = [torch.randn(2, 3, 6, requires_grad=True) for _ in range(4)]  # as activations from a stage
    want = _autograd_grads(model, batches)
    model.zero_grad(set_to_none=True)
    store = WeightGradientStore()
    for x in batches:
        with FusedWeightGradients(model.parameters(), store=store):
            out = model(x)
        out.square().sum().backward()
    assert all(p.grad is None for p in model.parameters())  # nothing yet: it all waits in the store
    assert len(store) == 3  # proj.weight with its bias, proj.weight without, and out.weight
    store.flush()
    assert len(store) == 0
    for param, grad in zip(model.parameters(), want, strict=True):
        assert param.grad is not None and param.grad.grad_fn is None and not param.grad.requires_grad
        torch.testing.assert_close(param.grad, grad, atol=1e-5, rtol=1e-5)


def test_only_schedules_whose_forwards_come_first_defer() -> None:
    assert forwards_first(build("gpipe", 2, 4).ranks[1])
    assert not forwards_first(build("1f1b", 2, 4).ranks[1])
    assert forwards_first(build("1f1b", 2, 1).ranks[0])  # one micro-batch: F then B


def _held(actions: Sequence[Action], pool: int | None, stage: int | None = None) -> int:
    """The most (stage, micro-batch) pairs held at once, forwarded and not yet backward, or pooled and not flushed.

    ``stage``: count only that stage's pairs (the pool still fills with every stage's backwards).
    """
    in_flight: set[tuple[int, int]] = set()
    pooled: set[tuple[int, int]] = set()
    peak = 0
    for action in actions:
        pair = (action.stage, action.microbatch)
        if action.kind is Kind.F:
            in_flight.add(pair)
        elif action.kind.is_backward:
            in_flight.remove(pair)
            pooled.add(pair)
            if pool is not None and len(pooled) == pool:
                pooled.clear()
        peak = max(peak, len({p for p in in_flight | pooled if stage is None or p[0] == stage}))
    return peak


@pytest.mark.parametrize(
    ("name", "n_stages", "n_virtual", "m", "pools"),
    [
        ("gpipe", 2, 1, 8, [None, None]),  # the whole step: its forwards come first
        ("1f1b", 2, 1, 8, [1, 2]),
        ("1f1b", 4, 1, 8, [1, 2, 3, 4]),
        ("1f1b", 1, 1, 4, [1]),
        ("1f1b", 2, 1, 1, [1, 1]),
        ("interleaved-1f1b", 4, 2, 8, [1, 3]),
        ("interleaved-1f1b", 6, 2, 6, [1, 3, 5]),
    ],
)
def test_the_free_pool_is_the_largest_within_the_pipelines_peak(
    name: ScheduleName, n_stages: int, n_virtual: int, m: int, pools: list[int | None]
) -> None:
    schedule = build(name, n_stages, m, n_virtual=n_virtual)
    assert [free_pool(schedule, rank) for rank in range(schedule.n_ranks)] == pools
    limit = max(_held(actions, 1) for actions in schedule.ranks)
    for rank, pool in enumerate(pools):
        mine = schedule.ranks[rank]
        assert _held(mine, pool) <= limit
        backwards = sum(a.kind.is_backward for a in mine)
        bigger = range((pool or backwards) + 1, backwards + 1)
        assert all(_held(mine, k) > limit for k in bigger), (rank, pool)
    # The moments of each stage that the planner's memory model weighs: in flight and pooled, none dominated.
    peaks = peak_in_flight(schedule)
    for rank, pool in enumerate(pools):
        for stage in schedule.stages_of(rank):
            want = (Holding(peaks[stage]),) if pool == 1 else _moments(schedule.ranks[rank], pool, stage)
            assert holdings(schedule)[stage] == want, (rank, stage)
            # The free pool's budget, counted in micro-batches, is the fullest moment's.
            assert max(h.in_flight + h.pooled for h in want) == (
                _held(schedule.ranks[rank], pool, stage) if pool != 1 else peaks[stage]
            )
    assert holdings(schedule, checkpointing=True) == tuple((Holding(q),) for q in peaks)  # "free" pools nothing


def _moments(actions: Sequence[Action], pool: int | None, stage: int) -> tuple[Holding, ...]:
    """Every (in flight, pooled) count of ``stage`` after an action, before a flush, without the dominated ones."""
    in_flight: set[int] = set()
    pooled: set[tuple[int, int]] = set()
    seen = set()
    for action in actions:
        if action.kind is Kind.F:
            if action.stage == stage:
                in_flight.add(action.microbatch)
        elif action.kind.is_backward:
            if action.stage == stage:
                in_flight.remove(action.microbatch)
            pooled.add((action.stage, action.microbatch))
        else:
            continue
        seen.add((len(in_flight), sum(s == stage for s, _ in pooled)))
        if pool is not None and len(pooled) == pool:
            pooled.clear()
    return tuple(
        Holding(a, b) for a, b in sorted(seen) if not any(x >= a and y >= b and (x, y) != (a, b) for x, y in seen)
    )


def test_holdings_follow_the_chosen_pool() -> None:
    schedule = build("1f1b", 2, 8)
    assert holdings(schedule, WeightGradientFusion(pool=None)) == ((Holding(2),), (Holding(1),))  # 1F1B pools nothing
    # Without fusion (PipelineOptions(fuse_weight_gradients=WeightGradientFusion.off())) autograd accumulates:
    # GPipe too holds only its forwards.
    assert holdings(build("gpipe", 2, 4), None) == ((Holding(4),),) * 2
    assert holdings(build("gpipe", 2, 4), WeightGradientFusion.off()) == ((Holding(4),),) * 2
    assert holdings(schedule, WeightGradientFusion(pool=3)) == tuple(_moments(schedule.ranks[r], 3, r) for r in (0, 1))
    gpipe = holdings(build("gpipe", 2, 4), WeightGradientFusion(pool=None))
    assert gpipe == ((Holding(0, 4), Holding(1, 3), Holding(2, 2), Holding(3, 1), Holding(4, 0)),) * 2
    # A split backward: micro-batches from F to W, and those whose output gradients wait from I to W.
    assert holdings(build("zero-bubble", 2, 4), WeightGradientFusion(pool=2)) == ((Holding(3, 2),), (Holding(2, 2),))


class _LocalTransport:
    """A one-stage pipeline's transport: nothing travels, nothing is pooled."""

    device = torch.device("cpu")

    def wait_sends(self) -> None:
        pass

    def release(self, payload: object) -> None:
        pass


@pytest.mark.parametrize(
    ("schedule", "pool", "flushes"),
    [
        ("gpipe", None, [1]),  # all of the step's, at its end
        ("1f1b", None, []),  # nothing pooled: 1F1B keeps only its in-flight micro-batches
        ("1f1b", 2, [1, 1, 0]),  # after backwards 2 and 4, and the (empty) end of the step
        ("1f1b", 3, [1, 1]),
        ("1f1b", "free", []),  # one stage: it holds one micro-batch in flight, so nothing fits beside it
        ("gpipe", "free", [1]),
        ("gpipe", 1, []),
        ("zero-bubble", None, [1, 1, 1, 1]),  # each micro-batch's W computes what its I left
        ("zero-bubble", 2, [1, 1, 1, 1]),  # a split backward pools nothing
    ],
)
def test_backwards_pool_their_weight_gradients_as_configured(
    schedule: str, pool: int | Literal["free"] | None, flushes: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``flushes``: 1 for each flush of pending gradients for every linear weight, 0 for one with none pending."""
    seen: list[int] = []
    flush = WeightGradientStore.flush
    monkeypatch.setattr(WeightGradientStore, "flush", lambda store: (seen.append(len(store)), flush(store)))
    chain = Chain(("linear", "gelu", "linear", "residual", "linear"), seed=6)
    x, y = chain.batch(9, 0)
    model = chain.build()
    want = [g / 9 for g in _autograd_grads(model, [x])]  # the mean over the batch's rows, as the pipeline's loss
    stage = StageModule(0, 0, layers_of(model), fusion=WeightGradientFusion.every(pool))
    model.zero_grad(set_to_none=True)
    executor = Executor(build(schedule, 1, 4), 0, {0: stage}, _LocalTransport(), [0], fusion=stage.fusion)  # type: ignore[arg-type]
    run = executor.run(executor.schedule.ranks[0], split(x, 4, what="x"), split(y, 4, what="y"), sum_of_squares)
    assert seen == [n * sum(isinstance(m, nn.Linear) for m in model.modules()) for n in flushes]
    assert run.loss is not None
    torch.testing.assert_close(run.loss, model(x).square().sum() / 9)
    for param, grad in zip(stage.parameters(), want, strict=True):
        torch.testing.assert_close(param.grad, grad, atol=1e-5, rtol=1e-5)


def sum_of_squares(output: object, target: object) -> torch.Tensor:
    """The loss of the test above: a micro-batch's sum of squares per row (the mean reduction weighs rows)."""
    assert isinstance(output, torch.Tensor)
    return output.square().sum() / output.shape[0]


class ScaledIn(nn.Module):
    """A parameter of its own that autograd reaches only through a fused linear: ``proj(x * scale)``."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, d))
        self.proj = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.proj(x * self.scale)
        return out


def test_zero_bubbles_w_adds_fused_gradients_once_and_runs_autograd_for_the_rest(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(6, 6), nn.LayerNorm(6), ScaledIn(6), nn.GELU(), nn.Linear(6, 3))
    x, y = torch.randn(7, 6), torch.randn(7, 3)
    want = [g / 7 for g in _autograd_grads(model, [x])]
    graphs: list[bool] = []  # for each W's flush: whether every fused weight's .grad was still untouched
    flush = WeightGradientStore.flush
    fused = [model[0].weight, model[2].proj.weight, model[4].weight]

    def spy(store: WeightGradientStore) -> None:
        graphs.append(len(store) == 3)
        flush(store)

    monkeypatch.setattr(WeightGradientStore, "flush", spy)
    stage = StageModule(0, 0, layers_of(model), fusion=WeightGradientFusion.every())
    model.zero_grad(set_to_none=True)
    executor = Executor(build("zero-bubble", 1, 3), 0, {0: stage}, _LocalTransport(), [0], fusion=stage.fusion)  # type: ignore[arg-type]
    executor.run(executor.schedule.ranks[0], split(x, 3, what="x"), split(y, 3, what="y"), sum_of_squares)
    assert graphs == [True, True, True]  # one flush per W, each with the three linear weights
    assert all(w.grad is not None for w in fused)
    # ScaledIn.scale's W runs autograd back through proj's fused op: proj.weight's gradient must not be added twice
    for param, grad in zip(stage.parameters(), want, strict=True):
        torch.testing.assert_close(param.grad, grad, atol=1e-5, rtol=1e-5)


def _equals_autograd_alone(
    model: nn.Module, schedule: Schedule, fusion: WeightGradientFusion | None, x: torch.Tensor, y: torch.Tensor
) -> None:
    """Run ``schedule`` (3 micro-batches) on one rank that holds all of ``model``: its gradients are autograd's."""
    want = [g / len(x) for g in _autograd_grads(model, [x])]
    stage = StageModule(0, 0, layers_of(model), fusion=fusion)
    model.zero_grad(set_to_none=True)
    executor = Executor(schedule, 0, {0: stage}, _LocalTransport(), [0], fusion=fusion)  # type: ignore[arg-type]
    executor.run(schedule.ranks[0], split(x, 3, what="x"), split(y, 3, what="y"), sum_of_squares)
    for (name, param), grad in zip(stage.named_parameters(), want, strict=True):
        torch.testing.assert_close(param.grad, grad, atol=1e-5, rtol=1e-5, msg=name)


@pytest.mark.parametrize("fusion", [None, WeightGradientFusion.every()], ids=["autograd", "fused"])
def test_a_schedule_that_splits_some_backwards_and_not_others(fusion: WeightGradientFusion | None) -> None:
    torch.manual_seed(4)
    model = nn.Sequential(nn.Linear(6, 6), nn.GELU(), nn.Linear(6, 3))
    x, y = torch.randn(7, 6), torch.randn(7, 3)
    schedule = Schedule.from_text("rank 0: 0F0 0B0 0F1 0I1 0F2 0W1 0B2")
    validate(schedule)
    _equals_autograd_alone(model, schedule, fusion, x, y)


class ReadTwice(nn.Module):
    """Reads its linear's weight a second time outside ``proj``'s own call: ``gelu(proj(x)) @ proj.weight.T``."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.proj = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.proj(x)) @ self.proj.weight.t()


@pytest.mark.parametrize("fusion", [None, WeightGradientFusion.every()], ids=["autograd", "fused"])
def test_zero_bubbles_w_covers_every_read_of_a_parameter(fusion: WeightGradientFusion | None) -> None:
    torch.manual_seed(5)
    model = nn.Sequential(nn.Linear(6, 6), nn.LayerNorm(6), ReadTwice(6))
    x, y = torch.randn(7, 6), torch.randn(7, 6)
    _equals_autograd_alone(model, build("zero-bubble", 1, 3), fusion, x, y)


class CalledTwice(nn.Module):
    """One linear applied twice, then its weight read once more by a matmul: every read depends on the ones before."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.proj = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.matmul(torch.tanh(self.proj(torch.tanh(self.proj(x)))), self.proj.weight)


@pytest.mark.parametrize("fusion", [None, WeightGradientFusion.every()], ids=["autograd", "fused"])
def test_zero_bubbles_w_counts_a_parameter_read_on_top_of_its_own_reads_once(
    fusion: WeightGradientFusion | None,
) -> None:
    torch.manual_seed(7)
    model = nn.Sequential(nn.Linear(6, 6), CalledTwice(6), nn.LayerNorm(6))
    x, y = torch.randn(7, 6), torch.randn(7, 6)
    _equals_autograd_alone(model, build("zero-bubble", 1, 3), fusion, x, y)


def test_parameter_uses_records_each_read_once_with_what_it_computed() -> None:
    torch.manual_seed(6)
    model = ReadTwice(4)
    frozen = nn.Parameter(torch.ones(4), requires_grad=False)
    uses: list[WeightUse] = []
    with ParameterUses([*model.parameters(), frozen], uses):
        out = model(torch.randn(3, 4)) * frozen  # the frozen parameter is no weight use
        with torch.no_grad():
            model.proj(torch.randn(3, 4))  # nor is a read without grad mode
    weight, bias = model.proj.weight, model.proj.bias
    assert [tuple(id(p) for p in use.params) for use in uses] == [
        (id(weight), id(bias)),  # F.linear in proj's forward
        (id(weight),),  # proj.weight.t(), whose output the matmul reads
    ]
    assert isinstance(uses[1].output, torch.Tensor) and uses[1].output.shape == (4, 4)
    assert out.requires_grad


@pytest.mark.parametrize(("checkpointing", "pool"), [(False, 2), (True, 1)])
def test_the_executor_pools_what_rank_pool_chooses(checkpointing: bool, pool: int) -> None:
    """Rank 1 of 1F1B on 2 ranks pools 2 backwards by default, none when its stage recomputes activations."""
    chain = Chain(("linear", "gelu", "linear"), seed=3)
    stage = StageModule(
        1,
        1,
        layers_of(chain.build()),
        compute=Compute(activation_checkpointing=checkpointing),
        fusion=WeightGradientFusion(),
    )
    executor = Executor(build("1f1b", 2, 6), 1, {1: stage}, _LocalTransport(), [0, 1], fusion=stage.fusion)  # type: ignore[arg-type]
    assert executor.pool == pool


def _fused(out: torch.Tensor) -> bool:
    return "AccumulatingLinear" in type(out.grad_fn).__name__


def test_linears_the_fused_backward_cannot_take_run_unchanged_and_keep_autograds_gradients() -> None:
    # Each of these was fused: a vector weight and a broadcast bias crashed in the backward; a bias that is
    # not the stage's own (received from the stage before) and F.linear(w, w) lost part of their gradients.
    torch.manual_seed(0)
    w, v = nn.Parameter(torch.randn(3, 3)), nn.Parameter(torch.randn(3))
    row_bias, own_bias = nn.Parameter(torch.randn(1, 3)), nn.Parameter(torch.randn(3))
    received = torch.randn(3, requires_grad=True)  # a leaf, as a stage's received input is
    x = torch.randn(2, 3)
    cases = {
        "vector weight": lambda: F.linear(x, v),
        "broadcast bias": lambda: F.linear(x, w, row_bias),
        "received bias": lambda: F.linear(x, w, received),
        "weight as input": lambda: F.linear(w, w),
    }
    own = frozenset(id(p) for p in (w, v, row_bias, own_bias))
    for name, call in cases.items():
        want = torch.autograd.grad(call().square().sum(), [w, v, row_bias, received], allow_unused=True)
        with FusedWeightGradients([w, v], own=own):
            out = call()
        assert not _fused(out), name
        got = torch.autograd.grad(out.square().sum(), [w, v, row_bias, received], allow_unused=True)
        for g, expected in zip(got, want, strict=True):
            assert (g is None) == (expected is None), name
            if g is not None:
                torch.testing.assert_close(g, expected, msg=name)
    with FusedWeightGradients([w], own=own):
        assert _fused(F.linear(x, w, own_bias))  # the stage's own (out,) bias: fused as before


def test_a_weight_tied_to_a_sparse_embedding_accumulates_into_its_sparse_gradient() -> None:
    # The embedding's backward leaves a sparse .grad; the pooled fused GEMM then failed in addmm_.
    torch.manual_seed(0)
    embed = nn.Embedding(6, 4, sparse=True)
    ids = torch.tensor([[1, 2], [3, 1]])

    def forward() -> torch.Tensor:
        return F.linear(F.gelu(embed(ids)), embed.weight)  # the LM head tied to the embedding

    forward().square().sum().backward()
    want = embed.weight.grad.to_dense()  # type: ignore[union-attr]
    embed.weight.grad = None
    store = WeightGradientStore()
    with FusedWeightGradients([embed.weight], store=store):
        out = forward()
    assert _fused(out)
    out.square().sum().backward()  # the embedding's sparse gradient first; the pooled head's at the flush
    store.flush()
    torch.testing.assert_close(embed.weight.grad.to_dense(), want)  # type: ignore[union-attr]
