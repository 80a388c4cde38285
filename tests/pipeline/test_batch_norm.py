"""Batch norms in a pipeline: micro-batches normalised with their own statistics, running statistics moved once
per step from the whole batch (PipelineOptions.batch_norm)."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from support.in_place import NormThenReLUInPlace
from support.multiproc import run_ranks
from support.resnet import resnet
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from stagewise.comm import PipelineMesh, init_mesh
from stagewise.partition import CapturedChain, Layer, Partition, capture, layers_of
from stagewise.pipeline import Compute, Loss, Pipeline, PipelineOptions
from stagewise.pipeline.stage.batch_norm import DeferredBatchNorm, Moments, statistics_source, update_running
from stagewise.pipeline.stage.module import StageModule

STEPS = 3
LR = 0.1
ATOL = 1e-5
STATISTICS = ("running_mean", "running_var", "num_batches_tracked")


def statistics(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The batch norms' running statistics among a state dict's entries."""
    return {k: v for k, v in state.items() if k.rsplit(".", 1)[-1] in STATISTICS}


def worst(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    """The largest absolute difference over the entries of ``want``, all of which ``got`` must have."""
    assert sorted(got) == sorted(want)
    return max(float((got[k].detach().double() - want[k].detach().double()).abs().max()) for k in want)


# --- the statistics update itself, in one process ---------------------------------------------------------------


@pytest.mark.parametrize("momentum", [0.1, None])
@pytest.mark.parametrize("shape", [(7, 5), (7, 5, 4), (7, 5, 3, 2)])
def test_one_update_from_micro_batch_moments_equals_torch_on_the_whole_batch(
    shape: tuple[int, ...], momentum: float | None
) -> None:
    kind = {2: nn.BatchNorm1d, 3: nn.BatchNorm1d, 4: nn.BatchNorm2d}[len(shape)]
    torch.manual_seed(0)
    mine, torchs = kind(5, momentum=momentum), kind(5, momentum=momentum)
    for step in range(STEPS):
        x = torch.randn(shape) * 3 + 40 * (step + 1)  # a mean far from 0: the sums must not cancel
        moments = [Moments.of(part) for part in x.tensor_split(3)]  # 3, 2, 2 samples
        update_running(mine, moments[0] + moments[1] + moments[2])
        torchs(x)
    assert int(mine.num_batches_tracked) == STEPS
    assert worst(statistics(mine.state_dict()), statistics(torchs.state_dict())) < ATOL


# --- a stage's batch norms, in one process ------------------------------------------------------------------------


@dataclass
class Unsplit:
    """The unsplit model trained by gradient accumulation over micro-batches (each normalised with its own
    statistics), and its batch norms' running statistics moved once per step by torch's batch norm itself, on
    the concatenated inputs of the micro-batches of each group (a replica's batch, or the global batch)."""

    model: nn.Module
    groups: int = 1
    losses: list[float] = field(default_factory=list)
    grads: dict[str, torch.Tensor] = field(default_factory=dict)
    """The gradients of the first step."""
    twins: list[dict[str, _BatchNorm]] = field(default_factory=list)

    def __post_init__(self) -> None:
        norms = {n: m for n, m in self.model.named_modules() if isinstance(m, _BatchNorm)}
        self.twins = [copy.deepcopy(norms) for _ in range(self.groups)]

    def step(self, parts: list[list[torch.Tensor]], targets: list[list[torch.Tensor]] | None = None) -> None:
        """One step over ``parts[group]``, the micro-batches of each group (their targets alike, or none: the
        sum of the outputs is the loss)."""
        norms = {n: m for n, m in self.model.named_modules() if isinstance(m, _BatchNorm)}
        seen: dict[str, list[torch.Tensor]] = {n: [] for n in norms}
        hooks = [m.register_forward_pre_hook(lambda _, a, n=n: seen[n].append(a[0].detach())) for n, m in norms.items()]
        samples = sum(len(x) for group in parts for x in group)
        for group, micro in enumerate(parts):
            for n in seen:
                seen[n] = []
            for i, x in enumerate(micro):
                out = self.model(x)
                weight = len(x) / samples
                loss = out.sum() if targets is None else F.cross_entropy(out, targets[group][i]) * weight
                loss.backward()
                self.losses.append(loss.item())
            for n, twin in self.twins[group].items():
                twin.train()
                twin(torch.cat(seen[n]))  # torch's own update, once, on the whole batch of this layer's inputs
        for hook in hooks:
            hook.remove()
        if not self.grads:
            self.grads = {n: p.grad.clone() for n, p in self.model.named_parameters() if p.grad is not None}

    def statistics(self, group: int = 0) -> dict[str, torch.Tensor]:
        return {
            f"{n}.{k}": v for n, twin in self.twins[group].items() for k, v in statistics(twin.state_dict()).items()
        }


def deferred_stage(model: nn.Module, *, checkpointing: bool = False) -> tuple[StageModule, DeferredBatchNorm]:
    """All of ``model``'s layers as one stage whose batch norms move their statistics once per commit."""
    stage = StageModule(0, 0, layers_of(model), compute=Compute(activation_checkpointing=checkpointing))
    norms = DeferredBatchNorm({0: stage})
    stage.batch_norms = norms.stages[0]
    return stage, norms


@pytest.fixture(scope="module")
def captured() -> CapturedChain:
    """The test ResNet captured by torch.export (momentum is fixed: a cumulative average does not export)."""
    return capture(resnet(cumulative=None), torch.randn(3, 3, 8, 8))


@pytest.mark.parametrize("kind", ["modules", "captured, recomputed"])
def test_a_stage_moves_its_statistics_once_per_step(kind: str, captured: CapturedChain) -> None:
    # Forwards under a stage's StageNorms collect; a commit moves each batch norm once. A recomputation
    # (activation checkpointing) and a forward without gradients add nothing; a captured graph's aten.batch_norm
    # is deferred as a module's F.batch_norm is.
    model: nn.Module = resnet() if kind == "modules" else copy.deepcopy(captured)
    reference = Unsplit(resnet() if kind == "modules" else resnet(cumulative=None))
    stage, norms = deferred_stage(model, checkpointing=kind != "modules")
    g = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        micro = list((torch.randn(7, 3, 8, 8, generator=g) * 2 + 1).tensor_split(3))
        reference.step([micro])
        norms.begin()
        for x in micro:
            out = stage.run(x)
            assert isinstance(out, torch.Tensor)
            out.sum().backward()
        norms.commit()
        with torch.no_grad():
            stage.run(micro[0])  # a forward-only pass in training mode
    got = statistics(model.state_dict())
    assert int(got["stem.bn.num_batches_tracked"]) == STEPS
    assert worst(got, reference.statistics()) < ATOL


def test_a_forward_that_fails_and_runs_again_counts_once() -> None:
    # The stage's first forward fails on the in-place change of its input after the batch norm ran, and runs
    # again on a copy: what the failed one saw is dropped.
    torch.manual_seed(0)
    model = nn.Sequential(NormThenReLUInPlace(6), nn.Linear(6, 2))
    reference = Unsplit(copy.deepcopy(model))
    stage, norms = deferred_stage(model)
    micro = list(torch.randn(8, 6).tensor_split(2))
    reference.step([[x.clone() for x in micro]])  # the model changes its input
    norms.begin()
    for x in micro:
        out = stage.run(x.clone().requires_grad_())
        assert isinstance(out, torch.Tensor)
        out.sum().backward()
    norms.commit()
    assert stage.copies_input
    assert worst(statistics(model.state_dict()), reference.statistics()) < ATOL


# --- choosing and refusing ------------------------------------------------------------------------------------------


def test_auto_defers_where_a_model_has_batch_norms_and_several_micro_batches() -> None:
    untracked = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4, track_running_stats=False))
    assert statistics_source("auto", layers_of(resnet()), 2) == "batch"
    assert statistics_source("auto", layers_of(resnet()), 1) == "micro-batch"
    assert statistics_source("auto", layers_of(nn.Sequential(nn.Linear(4, 4))), 4) == "micro-batch"
    assert statistics_source("auto", layers_of(untracked), 4) == "micro-batch"
    assert statistics_source("global-batch", layers_of(resnet()), 1) == "global-batch"
    assert PipelineOptions().batch_norm == "auto"


def test_an_unknown_choice_is_refused() -> None:
    with pytest.raises(ValueError, match=r"^PipelineOptions.batch_norm must be one of 'auto', 'micro-batch', "):
        PipelineOptions(batch_norm="sync")  # type: ignore[arg-type]


def test_a_captured_graph_that_updates_statistics_in_its_ops_is_refused(captured: CapturedChain) -> None:
    layers: list[Layer] = layers_of(captured)
    node = next(n for n in layers[0].module.graph.module.graph.nodes if n.target == torch.ops.aten.batch_norm.default)
    node.target = torch.ops.aten._native_batch_norm_legit_functional.default  # as older torch.export wrote it
    try:
        with pytest.raises(ValueError, match=r"cannot defer the running statistics of captured segments \['<input>'\]"):
            statistics_source("batch", layers, 2)
        assert statistics_source("auto", layers, 2) == "micro-batch"
    finally:
        node.target = torch.ops.aten.batch_norm.default


# --- pipelines on 2 gloo processes: every case in one launch ------------------------------------------------------


@dataclass(frozen=True)
class Case:
    name: str
    schedule: str
    m: int
    bounds: tuple[int, ...]
    batch: int = 7
    """Samples per replica and step."""
    dp: int = 1
    n_virtual: int = 1
    batch_norm: str = "auto"
    checkpointing: bool = False
    alike: bool = False
    """Each step's batch is ``m`` copies of one micro-batch: micro-batch statistics are the whole batch's."""


PIPELINES = [  # pp=2; the test ResNet's 6 layers: stem, blocks.0 .. blocks.3, head
    Case("gpipe m=2", "gpipe", 2, (0, 3, 6)),
    Case("1f1b m=3", "1f1b", 3, (0, 2, 6)),
    Case("zero-bubble m=3", "zero-bubble", 3, (0, 4, 6)),
    Case("interleaved m=2", "interleaved-1f1b", 2, (0, 2, 3, 4, 6), n_virtual=2),
    Case("1f1b m=3 checkpointing", "1f1b", 3, (0, 3, 6), checkpointing=True),
    Case("1f1b m=2 alike", "1f1b", 2, (0, 3, 6), batch=8, alike=True),
    Case("1f1b m=2 alike per micro-batch", "1f1b", 2, (0, 3, 6), batch=8, alike=True, batch_norm="micro-batch"),
]
REPLICAS = [  # pp=1 x dp=2
    Case("dp=2 global batch m=2", "1f1b", 2, (0, 6), dp=2, batch_norm="global-batch"),
    Case("dp=2 replica batch m=3", "gpipe", 3, (0, 6), dp=2),
]


def batches(case: Case) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each step's global batch (the replicas' batches one after another) and its labels."""
    g = torch.Generator().manual_seed(3)
    out = []
    for _ in range(STEPS):
        size = case.batch * case.dp // (case.m if case.alike else 1)
        x, y = torch.randn(size, 3, 8, 8, generator=g) * 2 + 1, torch.randint(0, 3, (size,), generator=g)
        out.append((x.repeat(case.m, 1, 1, 1), y.repeat(case.m)) if case.alike else (x, y))
    return out


def train_case(case: Case, mesh: PipelineMesh) -> dict[str, Any]:
    options = PipelineOptions(
        n_virtual=case.n_virtual,
        batch_norm=case.batch_norm,  # type: ignore[arg-type]
        compute=Compute(activation_checkpointing=case.checkpointing),
        loss=Loss(nonfinite="skip"),
    )
    part = Partition.from_bounds(case.bounds)
    with Pipeline(resnet(), part, schedule=case.schedule, n_microbatches=case.m, loss_fn=F.cross_entropy,  # type: ignore[arg-type]
                  mesh=mesh, options=options) as pipe:  # fmt: skip
        opt = torch.optim.SGD(pipe.parameters(), lr=LR)
        losses, grads = [], {}
        for step, (x, y) in enumerate(batches(case)):
            x, y = x.tensor_split(case.dp)[mesh.replica], y.tensor_split(case.dp)[mesh.replica]
            opt.zero_grad()
            losses.append(pipe.step(x, y).item())
            if step == 0:
                grads = {n: p.grad.clone() for n, p in pipe.named_parameters() if p.grad is not None}
            opt.step()
        trained = {k: v.clone() for k, v in pipe.state_dict().items()}
        pipe.eval()
        pipe.evaluate(x, y)
        pipe.train()
        pipe.evaluate(x, y)  # in training mode: normalised with micro-batch statistics, moving none
        pipe.predict(x)
        forward_only = [k for k, v in statistics(pipe.state_dict()).items() if not torch.equal(v, trained[k])]
        pipe.step(x * float("nan"), y)
        skipped = pipe.skipped
        skipped_moved = [k for k, v in statistics(pipe.state_dict()).items() if not torch.equal(v, trained[k])]
        return {
            "source": pipe._runtime.batch_norm,
            "losses": losses,
            "grads": grads,
            "state": trained,
            "forward_only_moved": forward_only,
            "skipped": skipped,
            "skipped_moved": skipped_moved,
        }


def train_all(pipelines: list[Case], replicas: list[Case]) -> dict[str, dict[str, Any]]:
    torch.set_num_threads(1)
    results = {}
    mesh = init_mesh(2, timeout=30)
    for case in pipelines:
        results[case.name] = train_case(case, mesh)
    mesh = init_mesh(1, 2, timeout=30)
    for case in replicas:
        results[case.name] = train_case(case, mesh)
    dist.destroy_process_group()
    return results


@dataclass(frozen=True)
class Trained:
    """Per case, what each rank returned (for pp=2 the stages' halves joined; for dp=2 each replica's)."""

    ranks: dict[int, dict[str, dict[str, Any]]]

    def joined(self, case: Case) -> dict[str, Any]:
        """A pp=2 case's results over both ranks: state and gradients joined, the loss rank 0's."""
        first, second = (self.ranks[r][case.name] for r in (0, 1))
        assert first["losses"] == second["losses"]
        return {**first, "state": first["state"] | second["state"], "grads": first["grads"] | second["grads"]}


@pytest.fixture(scope="module")
def trained() -> Trained:
    return Trained(run_ranks(train_all, 2, PIPELINES, REPLICAS, timeout=240))


def unsplit(case: Case, *, by_replica: bool = False) -> Unsplit:
    """The reference of ``case``: gradient accumulation over the same micro-batches, each replica's (with
    ``by_replica``) or the global batch's statistics moved once per step."""
    reference = Unsplit(resnet(), groups=case.dp if by_replica else 1)
    opt = torch.optim.SGD(reference.model.parameters(), lr=LR)
    for x, y in batches(case):
        opt.zero_grad()
        xs = [list(part.tensor_split(case.m)) for part in x.tensor_split(case.dp)]
        ys = [list(part.tensor_split(case.m)) for part in y.tensor_split(case.dp)]
        if by_replica:
            reference.step(xs, ys)
        else:
            reference.step([[x for part in xs for x in part]], [[y for part in ys for y in part]])
        opt.step()
    return reference


@pytest.mark.parametrize("case", [c for c in PIPELINES if c.batch_norm == "auto"], ids=lambda c: c.name)
def test_a_pipeline_moves_statistics_once_per_step_and_trains_as_gradient_accumulation(
    case: Case, trained: Trained
) -> None:
    got, want = trained.joined(case), unsplit(case)
    assert got["source"] == "batch"
    assert {int(v) for k, v in got["state"].items() if k.endswith("num_batches_tracked")} == {STEPS}
    assert worst(statistics(got["state"]), want.statistics()) < ATOL
    params = {k: v for k, v in got["state"].items() if k not in statistics(got["state"])}
    assert worst(params, dict(want.model.named_parameters())) < ATOL
    assert worst(got["grads"], want.grads) < ATOL
    steps = [sum(want.losses[i * case.m : (i + 1) * case.m]) for i in range(STEPS)]
    assert max(abs(a - b) for a, b in zip(got["losses"], steps, strict=True)) < ATOL


def whole_batch(case: Case) -> nn.Module:
    """The unsplit model trained on each step's whole batch at once."""
    model = resnet()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for x, y in batches(case):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return model


def test_with_alike_micro_batches_the_statistics_are_the_unsplit_models_on_the_whole_batch(trained: Trained) -> None:
    # Where each micro-batch's statistics are the whole batch's, the unsplit model trained on the whole batch
    # is the reference itself, for every layer; moving them once per micro-batch is far from it.
    deferred, per_micro_batch = (trained.joined(c) for c in PIPELINES if c.alike)
    model = whole_batch(PIPELINES[-1])
    assert worst(deferred["state"], model.state_dict()) < ATOL
    per_step = statistics(model.state_dict())
    assert {int(v) for k, v in statistics(per_micro_batch["state"]).items() if "num_batches" in k} == {2 * STEPS}
    assert max(float((per_micro_batch["state"][k] - v).abs().max()) for k, v in per_step.items()) > 0.1


def test_per_micro_batch_statistics_stay_on_request(trained: Trained) -> None:
    case = PIPELINES[-1]
    got = trained.joined(case)
    assert got["source"] == "micro-batch"
    want = unsplit(case).model.state_dict()  # the unsplit model's own batch norms: moved once per micro-batch
    assert worst(statistics(got["state"]), statistics(want)) < ATOL


@pytest.mark.parametrize("case", REPLICAS, ids=lambda c: c.name)
def test_replicas_move_statistics_over_the_global_or_their_own_batch(case: Case, trained: Trained) -> None:
    by_replica = case.batch_norm != "global-batch"
    want = unsplit(case, by_replica=by_replica)
    for rank in (0, 1):
        got = trained.ranks[rank][case.name]
        assert got["source"] == ("batch" if by_replica else "global-batch")
        assert worst(statistics(got["state"]), want.statistics(rank if by_replica else 0)) < ATOL
        assert worst(got["grads"], want.grads) < ATOL
    replicas = [statistics(trained.ranks[r][case.name]["state"]) for r in (0, 1)]
    assert (worst(replicas[0], replicas[1]) > 0.01) is by_replica


@pytest.mark.parametrize(
    "case", [c for c in PIPELINES + REPLICAS if c.batch_norm != "micro-batch"], ids=lambda c: c.name
)
def test_forward_only_passes_and_a_skipped_step_move_no_statistics(case: Case, trained: Trained) -> None:
    for rank in (0, 1):
        got = trained.ranks[rank][case.name]
        assert got["skipped"]
        assert got["forward_only_moved"] == [] and got["skipped_moved"] == []
