"""FSDP and tensor parallelism inside stages equal the unsplit model: losses, whole gradients, parameters.

One launch of 4 gloo processes runs every layout (pp2 x fsdp2, pp2 x tp2, fsdp2 x tp2, pp2 x dp2) and
schedule; each case's outcome comes back on its own, so one failing case fails its own test.
"""

from __future__ import annotations

import math
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
from stagewise.models.gpt import GPT, GPTConfig
from stagewise.models.gpt_parallel import plan as gpt_plan
from stagewise.partition import Partition
from stagewise.pipeline import Compute, Loss, Pipeline, PipelineOptions


@dataclass(frozen=True)
class Case:
    pp: int
    dp: int
    fsdp: int
    tp: int
    schedule: str
    n_microbatches: int
    tied: bool = True
    n_virtual: int = 1
    compile: str | None = None
    """The torch.compile backend the stages' layers are compiled with; None: eager."""

    @property
    def name(self) -> str:
        layout = f"pp{self.pp}-dp{self.dp}-fsdp{self.fsdp}-tp{self.tp}"
        compiled = f"-{self.compile}" if self.compile else ""
        return f"{layout}-{self.schedule}-m{self.n_microbatches}{'-tied' if self.tied else ''}{compiled}"


def model(case: Case) -> GPT:
    return gpt_steps.model(tied=case.tied)


def bounds(case: Case) -> tuple[int, ...]:
    """Stage bounds over the 7 layers: embed, 4 blocks, norm, head."""
    return {1: (0, 7), 2: (0, 3, 7), 4: (0, 2, 4, 5, 7)}[case.pp * case.n_virtual]


def unsplit(case: Case) -> dict[str, Any]:
    return gpt_steps.unsplit(tied=case.tied)


def _whole(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


MESHES: dict[tuple[int, ...], PipelineMesh] = {}
"""One mesh per layout, kept for the job, as a training process keeps its one mesh: a DeviceMesh of the same shape
built after another was closed would find torch's cached submeshes of the old one."""


def train(case: Case) -> dict[str, Any]:
    layout = (case.pp, case.dp, case.fsdp, case.tp)
    if layout not in MESHES:
        MESHES[layout] = init_mesh(case.pp, case.dp, fsdp=case.fsdp, tp=case.tp, timeout=60)
    mesh = MESHES[layout]
    pipe = Pipeline(
        model(case), Partition.from_bounds(bounds(case)), schedule=case.schedule,  # type: ignore[arg-type]
        n_microbatches=case.n_microbatches, loss_fn=GPTConfig.loss, mesh=mesh,  # type: ignore[arg-type]
        options=PipelineOptions(
            n_virtual=case.n_virtual, tensor_parallel=gpt_plan, compute=Compute(compile=case.compile or False)
        ),
    )  # fmt: skip
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-3)
    mine = mesh.share(BATCH)
    losses, norms, grads, collectives = [], [], [], []
    for ids, targets in batches():
        opt.zero_grad()
        COUNTS.clear()
        losses.append(pipe.step(ids[mine], targets[mine]).item())
        collectives.append(dict(COUNTS))
        grads.append({n: _whole(p.grad) for n, p in pipe.named_parameters() if p.grad is not None})
        norms.append(float(pipe.clip_grad_norm_(CLIP)))
        opt.step()
    params = {n: _whole(p) for n, p in pipe.named_parameters()}
    pipe.close()
    sharded = pipe._runtime.sharded
    units = len(sharded.units) if sharded is not None else 0
    return {
        "losses": losses, "norms": norms, "grads": grads, "params": params, "collectives": collectives, "units": units,
    }  # fmt: skip


COUNTS: dict[str, int] = {}
"""FSDP's all-gathers and reduce-scatters during the current step, by name."""


def _counting(name: str) -> None:
    """Count every call of ``torch.distributed.<name>`` (what FSDP's default collectives call) in ``COUNTS``."""
    original = getattr(dist, name)

    def counted(*args: Any, **kwargs: Any) -> Any:
        COUNTS[name] = COUNTS.get(name, 0) + 1
        return original(*args, **kwargs)

    setattr(dist, name, counted)


def mixed_dtypes() -> str:
    """The refusal of a stage whose parameters FSDP cannot flatten together (float32 and float64)."""
    mesh = MESHES[(1, 2, 2, 1)]  # every rank holds the one stage, so every rank refuses it
    chain = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4).double(), torch.nn.Linear(4, 4))
    try:
        Pipeline(chain, Partition.from_bounds((0, 3)), n_microbatches=1, loss_fn=torch.nn.functional.mse_loss,
                 mesh=mesh)  # fmt: skip
    except ValueError as err:
        return str(err)
    return "built"


def compiled_with_tp() -> str:
    """The refusal of compiled layers with tensor parallelism (pp2 x tp2)."""
    case = Case(2, 1, 1, 2, "1f1b", 2)
    try:
        options = PipelineOptions(tensor_parallel=gpt_plan, compute=Compute(compile=True))
        Pipeline(model(case), Partition.from_bounds(bounds(case)), n_microbatches=2, loss_fn=GPTConfig.loss,
                 mesh=MESHES[(2, 1, 1, 2)], options=options)  # fmt: skip
    except ValueError as err:
        return str(err)
    return "built"


POISON = [False]
"""While True, the loss of every micro-batch is NaN."""


def poisoned_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    loss = GPTConfig.loss(logits, targets)
    return loss * float("nan") if POISON[0] else loss


def skipping() -> dict[str, Any]:
    """pp2 x fsdp2 with ``nonfinite="skip"``: a good step, a NaN step that is skipped, then the second batch."""
    case = Case(2, 1, 2, 1, "1f1b", 2)
    mesh = MESHES[(2, 1, 2, 1)]
    pipe = Pipeline(
        model(case), Partition.from_bounds(bounds(case)), n_microbatches=2, loss_fn=poisoned_loss, mesh=mesh,
        options=PipelineOptions(loss=Loss(nonfinite="skip")),
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
    params = {n: _whole(p) for n, p in pipe.named_parameters()}
    pipe.close()
    return {"losses": losses, "skipped": skipped, "params": params}


def train_all(cases: list[Case]) -> dict[str, Any]:
    torch.set_num_threads(1)
    _counting("all_gather_single")
    _counting("reduce_scatter_single")
    out = each_case(train, cases)
    out["mixed dtypes"] = mixed_dtypes()
    out["compiled with tp"] = compiled_with_tp()
    out["skip"] = skipping()
    dist.destroy_process_group()
    return out


CASES = [
    Case(2, 1, 2, 1, "1f1b", 2),
    Case(2, 1, 2, 1, "zero-bubble", 3),
    Case(2, 1, 2, 1, "gpipe", 2, tied=False),
    Case(2, 1, 2, 1, "interleaved-1f1b", 2, n_virtual=2),
    Case(2, 1, 1, 2, "1f1b", 2),
    Case(2, 1, 1, 2, "zero-bubble", 2),
    Case(2, 1, 1, 2, "gpipe", 2, tied=False),
    Case(1, 1, 2, 2, "1f1b", 2),
    Case(1, 1, 2, 2, "zero-bubble", 2, tied=False),
    Case(2, 2, 1, 1, "1f1b", 2),
    Case(2, 2, 1, 1, "zero-bubble", 2),
    Case(1, 2, 2, 1, "1f1b", 2),  # HSDP: sharded within a replica, all-reduced across the two
    Case(1, 2, 1, 2, "gpipe", 2),  # tensor parallelism with replicas: HSDP over a shard of one
    # Compiled layers (AOTAutograd's graphs, run eagerly: compiled kernels are tested in test_compiled.py), whose
    # backward is one graph, so zero-bubble's I computes the weight gradients too, under FSDP and DDP.
    Case(2, 1, 2, 1, "zero-bubble", 3, compile="aot_eager"),
    Case(2, 2, 1, 1, "zero-bubble", 2, compile="aot_eager"),
    Case(2, 2, 1, 1, "1f1b", 2, tied=False, compile="aot_eager"),
]


@pytest.fixture(scope="module")
def outcomes() -> dict[int, dict[str, Any]]:
    """Every case on one launch of 4 processes: rank -> case name -> its results, or the traceback it raised."""
    per_rank: dict[int, dict[str, Any]] = run_ranks(train_all, 4, CASES, timeout=400)
    return per_rank


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_sharded_stages_equal_the_unsplit_model(case: Case, outcomes: dict[int, dict[str, Any]]) -> None:
    want = unsplit(case)
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
        # FSDP gathered each stage's parameters once a step and reduce-scattered its gradients once, for any m.
        # (A shard of one, tensor parallelism with replicas, gathers nothing: its replicas all-reduce.)
        units = got["units"] if case.fsdp > 1 else 0
        once = {"all_gather_single": units, "reduce_scatter_single": units} if units else {}
        assert got["collectives"] == [once] * STEPS, f"rank {rank}"
        sharded = case.fsdp > 1 or (case.tp > 1 and case.dp > 1)
        assert got["units"] == (case.n_virtual if sharded else 0), f"rank {rank}: one FSDP unit per stage"
    assert held >= set(want["params"]) - {"head.weight"}  # together the ranks hold the whole model


def test_a_stage_fsdp_cannot_shard_is_refused_in_one_line(outcomes: dict[int, dict[str, Any]]) -> None:
    for results in outcomes.values():
        message = results["mixed dtypes"]
        assert message.startswith(
            "stage 0 (layers 0 .. 2, parameters of dtypes ['float32', 'float64']) cannot be sharded by fully_shard: "
        ), message
        assert message.endswith("or train with fsdp=1"), message


def test_compiled_layers_with_tensor_parallelism_are_refused_in_one_line(
    outcomes: dict[int, dict[str, Any]],
) -> None:
    for results in outcomes.values():
        message = results["compiled with tp"]
        assert message.startswith("Compute.compile with tp=2: the tensor-parallel split turns"), message
        assert message.endswith("compile with tp=1 (fsdp and dp may be above 1), or leave compile off"), message


def test_tensor_parallelism_refuses_a_captured_graph_under_a_function_plan_and_a_missing_plan() -> None:
    # Captured graphs are split by a mapping of paths to styles (tests/pipeline/test_captured_tensor_parallel.py);
    # a function plan returns styles for modules, which a graph does not call.
    from stagewise.partition.segment import Segment
    from stagewise.pipeline.parallel.tensor_parallel import parallelize

    class TwoRanks:  # parallelize reads only the mesh's size before it refuses
        def size(self) -> int:
            return 2

    segment = Segment.__new__(Segment)
    with pytest.raises(ValueError, match=r"^layer blocks\.0 is a captured graph, which a function plan cannot split"):
        parallelize([segment], ["blocks.0"], TwoRanks(), gpt_plan)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^the mesh has tp=2 but no tensor-parallel plan was given; pass"):
        parallelize([torch.nn.Linear(2, 2)], ["head"], TwoRanks(), None)  # type: ignore[arg-type]


def test_a_non_finite_step_is_skipped_on_sharded_stages(outcomes: dict[int, dict[str, Any]]) -> None:
    want = unsplit(Case(2, 1, 2, 1, "1f1b", 2))  # its steps 1 and 2 are the skipping run's 1 and 3
    for rank, results in outcomes.items():
        got = results["skip"]
        assert got["skipped"] == [False, True, False], rank
        assert math.isnan(got["losses"][1]), rank
        torch.testing.assert_close([got["losses"][0], got["losses"][2]], want["losses"][:2], atol=1e-5, rtol=1e-5)
