"""FSDP gathered per micro-batch (``FullySharded(gather="micro-batch")``) and optimizer-state offload equal the
unsplit model, and really free: losses, parameters, all-gathers and reduce-scatters, whole parameters held.

One launch of 4 gloo processes runs every case; each case's outcome comes back on its own, so one failing case
fails its own test.
"""

from __future__ import annotations

import math
import traceback
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.distributed as dist
from support import gpt_steps
from support.gpt_steps import BATCH, CLIP, STEPS, batches
from support.multiproc import run_ranks
from support.outcomes import each_case
from torch.distributed.tensor import DTensor

from stagewise.comm import PipelineMesh, init_mesh
from stagewise.models.gpt import GPTConfig
from stagewise.models.gpt_parallel import plan as gpt_plan
from stagewise.partition import Partition
from stagewise.pipeline import FullySharded, Loss, Pipeline, PipelineOptions
from stagewise.schedule.actions import Action, Kind


@dataclass(frozen=True)
class Case:
    pp: int
    dp: int
    fsdp: int
    tp: int
    schedule: str
    n_microbatches: int
    gather: str = "micro-batch"
    offload: bool = False
    tied: bool = True
    n_virtual: int = 1
    fail_first: bool = False
    """Before the steps, a step whose loss raises at its last micro-batch on every rank (after earlier ones'
    backwards reduced): the pipeline must come out of it whole and train on as if it had not run."""

    @property
    def name(self) -> str:
        layout = f"pp{self.pp}-dp{self.dp}-fsdp{self.fsdp}-tp{self.tp}"
        extra = ("-offload" if self.offload else "") + ("-failed-first" if self.fail_first else "")
        tied = "-tied" if self.tied else ""
        return f"{layout}-{self.schedule}-m{self.n_microbatches}-{self.gather}{extra}{tied}"


CASES = [
    Case(2, 1, 2, 1, "1f1b", 3),
    Case(2, 1, 2, 1, "zero-bubble", 3),
    Case(2, 1, 2, 1, "zbv", 3, n_virtual=2, tied=False),
    Case(2, 1, 2, 1, "1f1b", 2, gather="step", offload=True),
    Case(2, 1, 2, 1, "1f1b", 2, offload=True),
    Case(1, 2, 2, 1, "1f1b", 2, fail_first=True),  # HSDP: sharded within a replica, all-reduced across the two
    Case(1, 1, 2, 2, "1f1b", 2),  # FSDP over tensor-parallel stages
]


def bounds(case: Case) -> tuple[int, ...]:
    """Stage bounds over the 7 layers: embed, 4 blocks, norm, head."""
    return {1: (0, 7), 2: (0, 3, 7), 4: (0, 2, 4, 5, 7)}[case.pp * case.n_virtual]


def _whole(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


MESHES: dict[tuple[int, ...], PipelineMesh] = {}
"""One mesh per layout, kept for the job (see test_sharded.py)."""

COUNTS: dict[str, int] = {}
"""FSDP's all-gathers and reduce-scatters during the current step, by name."""


def _counting(name: str) -> None:
    """Count every call of ``torch.distributed.<name>`` (what FSDP's default collectives call) in ``COUNTS``."""
    original = getattr(dist, name)

    def counted(*args: Any, **kwargs: Any) -> Any:
        COUNTS[name] = COUNTS.get(name, 0) + 1
        return original(*args, **kwargs)

    setattr(dist, name, counted)


FAIL = [False]
"""While True, the loss of the last micro-batch raises."""


def failing_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    if FAIL[0] and logits.shape[0] == 1:  # the last micro-batch of the failing step is one sample: see train()
        raise RuntimeError("injected failure")
    return GPTConfig.loss(logits, targets)


def mesh_of(case: Case) -> PipelineMesh:
    layout = (case.pp, case.dp, case.fsdp, case.tp)
    if layout not in MESHES:
        MESHES[layout] = init_mesh(case.pp, case.dp, fsdp=case.fsdp, tp=case.tp, timeout=60)
    return MESHES[layout]


def pipeline(case: Case, **loss: Any) -> Pipeline:
    config = FullySharded(gather=case.gather, offload=case.offload)  # type: ignore[arg-type]
    return Pipeline(
        gpt_steps.model(tied=case.tied), Partition.from_bounds(bounds(case)), schedule=case.schedule,  # type: ignore[arg-type]
        n_microbatches=case.n_microbatches, loss_fn=failing_loss, mesh=mesh_of(case),  # type: ignore[arg-type]
        options=PipelineOptions(
            n_virtual=case.n_virtual, tensor_parallel=gpt_plan, fully_sharded=config, loss=Loss(**loss)
        ),
    )  # fmt: skip


def _fail_once(pipe: Pipeline, case: Case, opt: torch.optim.Optimizer) -> str:
    """A step whose last micro-batch's loss raises on every rank; returns the error."""
    ids, targets = batches()[0]
    share = case.n_microbatches * 2 - 1  # micro-batches of 2 samples, the last of 1
    opt.zero_grad()
    FAIL[0] = True
    try:
        pipe.step(ids[:share], targets[:share])
    except RuntimeError as err:
        return str(err)
    finally:
        FAIL[0] = False
    return "no failure"


def train(case: Case) -> dict[str, Any]:
    mesh = mesh_of(case)
    pipe = pipeline(case)
    sharded = pipe._runtime.sharded
    assert sharded is not None
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-3)
    failed = _fail_once(pipe, case, opt) if case.fail_first else ""
    mine = mesh.share(BATCH)
    losses, norms, grads, collectives, peaks, whole_after = [], [], [], [], [], []
    for ids, targets in batches():
        opt.zero_grad()
        COUNTS.clear()
        sharded.reset_peak()
        losses.append(pipe.step(ids[mine], targets[mine]).item())
        collectives.append(dict(COUNTS))
        peaks.append(sharded.peak_bytes)
        whole_after.append(sorted(sharded.whole))
        grads.append({n: _whole(p.grad) for n, p in pipe.named_parameters() if p.grad is not None})
        norms.append(float(pipe.clip_grad_norm_(CLIP)))
        opt.step()
    ids, targets = batches()[0]
    evaluated = pipe.evaluate(ids[mine], targets[mine]).item()
    params = {n: _whole(p) for n, p in pipe.named_parameters()}
    groups = [g for unit in sharded.units.values() for g in unit._get_fsdp_state()._fsdp_param_groups]
    offloaded = sorted({fsdp_param.offload_to_cpu for group in groups for fsdp_param in group.fsdp_params})
    actions = [str(a) for a in pipe.schedule.ranks[pipe._runtime.position]]
    pipe.close()
    return {
        "losses": losses, "norms": norms, "grads": grads, "params": params, "collectives": collectives,
        "peaks": peaks, "sizes": dict(sharded.sizes), "whole after": whole_after, "evaluated": evaluated,
        "whole after evaluate": sorted(sharded.whole), "actions": actions, "failed": failed, "offloaded": offloaded,
    }  # fmt: skip


POISON = [False]
"""While True, the loss of every micro-batch is NaN."""


def poisoned_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    loss = GPTConfig.loss(logits, targets)
    return loss * float("nan") if POISON[0] else loss


def skipping() -> dict[str, Any]:
    """pp2 x fsdp2 per micro-batch with ``nonfinite="skip"``: a good step, a NaN step that is skipped, then the
    second batch."""
    case = Case(2, 1, 2, 1, "1f1b", 2)
    mesh = mesh_of(case)
    pipe = Pipeline(
        gpt_steps.model(tied=True), Partition.from_bounds(bounds(case)), n_microbatches=2,
        loss_fn=poisoned_loss, mesh=mesh,  # type: ignore[arg-type]
        options=PipelineOptions(loss=Loss(nonfinite="skip"), fully_sharded=FullySharded(gather="micro-batch")),
    )  # fmt: skip
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-3)
    mine = mesh.share(BATCH)
    data = batches()
    losses, skipped = [], []
    for poisoned, (ids, targets) in zip((False, True, False), (data[0], data[1], data[1]), strict=True):
        POISON[0] = poisoned
        opt.zero_grad()
        losses.append(pipe.step(ids[mine], targets[mine]).item())
        skipped.append(pipe.skipped)
        if not pipe.skipped:
            pipe.clip_grad_norm_(CLIP)
            opt.step()
    POISON[0] = False
    pipe.close()
    return {"losses": losses, "skipped": skipped}


def tied_on_one_rank() -> str:
    """The refusal of a tied GPT under zbv, whose V puts the embedding's and the head's stages on rank 0 (every
    rank refuses it, before anything is built)."""
    case = Case(2, 1, 2, 1, "zbv", 2, n_virtual=2)
    try:
        pipeline(case)
    except ValueError as err:
        return str(err)
    return "built"


def train_all(cases: list[Case]) -> dict[str, Any]:
    torch.set_num_threads(1)
    _counting("all_gather_single")
    _counting("reduce_scatter_single")
    out = each_case(train, cases)
    out["tied on one rank"] = tied_on_one_rank()
    try:
        out["skip"] = skipping()
    except Exception:
        out["skip"] = traceback.format_exc()
    dist.destroy_process_group()
    return out


@pytest.fixture(scope="module")
def outcomes() -> dict[int, dict[str, Any]]:
    """Every case on one launch of 4 processes: rank -> case name -> its results, or the traceback it raised."""
    per_rank: dict[int, dict[str, Any]] = run_ranks(train_all, 4, CASES, timeout=300)
    return per_rank


def unsplit_evaluation(case: Case, params: dict[str, torch.Tensor]) -> float:
    """The unsplit model's loss on the first batch, with ``params``."""
    net = gpt_steps.model(tied=case.tied)
    with torch.no_grad():
        for name, param in net.named_parameters(remove_duplicate=False):
            param.copy_(params[name])
        ids, targets = batches()[0]
        return GPTConfig.loss(net(ids), targets).item()


def expected_collectives(case: Case, actions: list[str], sizes: dict[int, int]) -> dict[str, int]:
    """FSDP's collectives on a rank in one step: under "micro-batch", one all-gather per run of a stage's actions
    and one reduce-scatter per backward that leaves parameter gradients (B, W); under "step", one of each per
    stage."""
    if case.gather == "step":
        return {"all_gather_single": len(sizes), "reduce_scatter_single": len(sizes)}
    parsed = [Action.parse(a) for a in actions]
    runs = sum(1 for i, a in enumerate(parsed) if i == 0 or parsed[i - 1].stage != a.stage)
    backwards = sum(1 for a in parsed if a.kind in (Kind.B, Kind.W))
    return {"all_gather_single": runs, "reduce_scatter_single": backwards}


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_sharded_per_microbatch_equals_the_unsplit_model(case: Case, outcomes: dict[int, dict[str, Any]]) -> None:
    want = gpt_steps.unsplit(tied=case.tied)
    held: set[str] = set()
    for rank, results in outcomes.items():
        got = results[case.name]
        assert not isinstance(got, str), f"rank {rank}: {got}"
        torch.testing.assert_close(got["losses"], want["losses"], atol=1e-5, rtol=1e-5, msg=f"rank {rank}")
        torch.testing.assert_close(got["norms"], want["norms"], atol=1e-5, rtol=1e-5, msg=f"rank {rank}")
        for step in range(STEPS):
            assert got["grads"][step], f"rank {rank} has no gradients at step {step}"
            for name, grad in got["grads"][step].items():
                torch.testing.assert_close(grad, want["grads"][step][name], atol=1e-5, rtol=1e-5, msg=name)
        for name, param in got["params"].items():
            torch.testing.assert_close(param, want["params"][name], atol=1e-5, rtol=1e-5, msg=name)
        held |= set(got["params"])
        want_eval = unsplit_evaluation(case, want["params"])
        assert math.isclose(got["evaluated"], want_eval, abs_tol=1e-5), (rank, got["evaluated"], want_eval)
        if case.fail_first:
            assert "injected failure" in got["failed"], f"rank {rank}: {got['failed']}"
    assert held >= set(want["params"]) - {"head.weight"}  # together the ranks hold the whole model


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_stages_are_gathered_around_their_actions_and_freed(case: Case, outcomes: dict[int, dict[str, Any]]) -> None:
    for rank, results in outcomes.items():
        got = results[case.name]
        assert not isinstance(got, str), f"rank {rank}: {got}"
        sizes = {int(s): n for s, n in got["sizes"].items()}
        want = expected_collectives(case, got["actions"], sizes)
        assert got["collectives"] == [want] * STEPS, f"rank {rank}: actions {got['actions']}"
        # At most one stage whole at a time per micro-batch (the next one's gather is issued once the last is
        # freed); every stage at once per step.
        most = max(sizes.values()) if case.gather == "micro-batch" else sum(sizes.values())
        assert got["peaks"] == [most] * STEPS, f"rank {rank}: sizes {sizes}"
        assert got["whole after"] == [[]] * STEPS, f"rank {rank}"
        assert got["whole after evaluate"] == [], f"rank {rank}"


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_offload_reaches_fsdp(case: Case, outcomes: dict[int, dict[str, Any]]) -> None:
    """With ``offload``, FSDP offloads every parameter of every stage (on this CPU mesh its host memory is the
    device's, so nothing moves; the equivalence above runs its offloading code)."""
    for rank, results in outcomes.items():
        got = results[case.name]
        assert not isinstance(got, str), f"rank {rank}: {got}"
        assert got["offloaded"] == [case.offload], f"rank {rank}"


def test_a_non_finite_step_is_skipped_per_microbatch(outcomes: dict[int, dict[str, Any]]) -> None:
    want = gpt_steps.unsplit(tied=True)  # its steps 1 and 2 are the skipping run's 1 and 3
    for rank, results in outcomes.items():
        got = results["skip"]
        assert not isinstance(got, str), f"rank {rank}: {got}"
        assert got["skipped"] == [False, True, False], rank
        assert math.isnan(got["losses"][1]), rank
        torch.testing.assert_close([got["losses"][0], got["losses"][2]], want["losses"][:2], atol=1e-5, rtol=1e-5)


def test_gather_and_offload_are_checked() -> None:
    with pytest.raises(ValueError, match=r"^FullySharded.gather must be 'step' or 'micro-batch', got 'layer'; "):
        FullySharded(gather="layer")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"^FullySharded.offload must be True or False, got 'yes'$"):
        FullySharded(offload="yes")  # type: ignore[arg-type]


def test_weights_tied_across_two_stages_of_one_rank_are_refused(outcomes: dict[int, dict[str, Any]]) -> None:
    for rank, results in outcomes.items():
        message = results["tied on one rank"]
        assert message.startswith(
            "stages 0 and 3 run on pipeline rank 0 and share the parameter 'embed.tokens.weight' (tied weights), "
        ), f"rank {rank}: {message}"
        assert message.endswith("untie them, or train without sharding"), message


def test_ties_within_a_rank_are_found_from_the_placement() -> None:
    from stagewise.partition import layers_of, shared_parameters
    from stagewise.pipeline.parallel.fully_sharded import refuse_ties_within_a_rank
    from stagewise.schedule.builders import build

    shared = shared_parameters(layers_of(gpt_steps.model(tied=True)))
    bounds = (0, 2, 4, 5, 7)
    refuse_ties_within_a_rank(shared, bounds, build("interleaved-1f1b", 4, 2, n_virtual=2))  # stages 0, 3: ranks 0, 1
    refuse_ties_within_a_rank(
        shared_parameters(layers_of(gpt_steps.model(tied=False))), bounds, build("zbv", 4, 2, n_virtual=2)
    )
    with pytest.raises(ValueError, match=r"^stages 0 and 3 run on pipeline rank 0 and share the parameter"):
        refuse_ties_within_a_rank(shared, bounds, build("zbv", 4, 2, n_virtual=2))
