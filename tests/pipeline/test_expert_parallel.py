"""Expert parallelism inside the pipeline equals the unsplit mixture-of-experts model: losses with the
load-balancing term, clipped norms, every gradient and the parameters after 3 AdamW steps.

One launch of 4 gloo processes runs pp2 x ep2 (over dp2), ep2 x fsdp2 (pp2 x fsdp2, the experts split over the
shards) and ep2 x tp2 (dp2 x tp2), each under 1F1B, zero-bubble and DualPipeV, with micro-batches of one sequence,
so some expert receives no token in some micro-batch (each run records that it happened); DualPipeV with its
forward and backward pairs run at once and one action at a time; the balancing by routing bias, a capacity that
drops tokens, and an embedding tied to the head across stages.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, replace
from typing import Any

import pytest
import torch
import torch.distributed as dist
from support import gpt_steps
from support.gpt_steps import BATCH, CLIP, STEPS, batches
from support.multiproc import run_ranks
from support.outcomes import each_case
from torch import nn
from torch.distributed.tensor import DTensor

from stagewise.comm import PipelineMesh, init_mesh
from stagewise.models import moe as moe_module
from stagewise.models.gpt import GPT, GPTConfig
from stagewise.models.gpt_parallel import plan as gpt_plan
from stagewise.models.moe import MoEConfig, auxiliary_loss, balance_experts
from stagewise.partition import Partition
from stagewise.pipeline import Compute, Pipeline, PipelineOptions

SEQ = 8
VOCAB = 64
MOE = MoEConfig(experts=8, top_k=2, d_expert=16, shared_experts=1, dense_layers=1, aux_loss_coefficient=0.1)


@dataclass(frozen=True)
class Case:
    pp: int
    dp: int
    fsdp: int
    tp: int
    schedule: str
    moe: MoEConfig = MOE
    label: str = ""
    overlap: bool = True
    tied: bool = False
    """The LM head's weight is the token embedding's (on two stages: their gradients are summed)."""
    """Run DualPipeV's forward and backward pairs at once (see stagewise.pipeline.execution.pairs; off by default)."""

    @property
    def n_virtual(self) -> int:
        return 2 if self.schedule == "dualpipev" else 1

    @property
    def n_microbatches(self) -> int:
        """One sequence per micro-batch: 8 tokens, 16 choices among 8 experts."""
        return BATCH // (self.dp * self.fsdp)

    @property
    def name(self) -> str:
        return f"pp{self.pp}-dp{self.dp}-fsdp{self.fsdp}-tp{self.tp}-ep2-{self.schedule}{self.label}"


def config(case: Case) -> GPTConfig:
    return GPTConfig(
        vocab_size=VOCAB, seq_len=SEQ, d_model=32, n_layers=4, n_heads=4, moe=case.moe, tie_embeddings=case.tied
    )


def model(case: Case) -> GPT:
    torch.manual_seed(3)
    return config(case).build()


def bounds(case: Case) -> tuple[int, ...]:
    """Stage bounds over the 7 layers: embed, 4 blocks (the first dense), norm, head."""
    return {1: (0, 7), 2: (0, 3, 7), 4: (0, 2, 4, 5, 7)}[case.pp * case.n_virtual]


def unsplit(case: Case) -> dict[str, Any]:
    """The unsplit model in one process: losses (with the balance loss, also on its own), clipped norms,
    gradients, parameters."""
    balance: list[float] = []

    def balance_loss_and_bias(net: nn.Module) -> float:
        balance_experts(net)  # the routing bias moved by the batch's load
        balance.append(float(auxiliary_loss(net)))
        return balance[-1]

    return gpt_steps.train_unsplit(model(case), after_backward=balance_loss_and_bias) | {"balance": balance}


def _whole(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


MESHES: dict[tuple[int, ...], PipelineMesh] = {}
EMPTY: list[bool] = []
"""Whether an expert received no token in a forward, one entry per experts' call."""


def _recording_empty_experts() -> None:
    forward = moe_module.Experts.forward

    def recorded(self: moe_module.Experts, tokens: torch.Tensor, counts: Any) -> torch.Tensor:
        EMPTY.append(0 in list(counts))
        return forward(self, tokens, counts)

    moe_module.Experts.forward = recorded  # type: ignore[method-assign]


def train(case: Case) -> dict[str, Any]:
    layout = (case.pp, case.dp, case.fsdp, case.tp)
    if layout not in MESHES:
        MESHES[layout] = init_mesh(case.pp, case.dp, fsdp=case.fsdp, tp=case.tp, ep=2, timeout=60)
    mesh = MESHES[layout]
    pipe = Pipeline(
        model(case), Partition.from_bounds(bounds(case)), schedule=case.schedule,  # type: ignore[arg-type]
        n_microbatches=case.n_microbatches, loss_fn=GPTConfig.loss, mesh=mesh,  # type: ignore[arg-type]
        options=PipelineOptions(
            n_virtual=case.n_virtual, tensor_parallel=gpt_plan, compute=Compute(overlap_all_to_all=case.overlap)
        ),
    )  # fmt: skip
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-3)
    mine = mesh.share(BATCH)
    losses, norms, grads, balance, paired = [], [], [], [], 0
    EMPTY.clear()
    for ids, targets in batches():
        opt.zero_grad()
        losses.append(pipe.step(ids[mine], targets[mine]).item())
        balance.append(float(pipe.balance_loss) if pipe.balance_loss is not None else math.nan)
        events = pipe._runtime.executor.last_events
        paired += sum(1 for a, b in itertools.pairwise(events) if a.start == b.start)
        grads.append({n: _whole(p.grad) for n, p in pipe.named_parameters() if p.grad is not None})
        norms.append(float(pipe.clip_grad_norm_(CLIP)))
        opt.step()
    params = {n: _whole(p) for n, p in pipe.named_parameters()}
    experts = {
        n: p.to_local().shape[0] for n, p in pipe.named_parameters() if isinstance(p, DTensor) and ".experts." in n
    }
    pipe.close()
    return {
        "losses": losses, "norms": norms, "grads": grads, "params": params, "experts": experts, "empty": any(EMPTY),
        "paired": paired, "balance": balance,
    }  # fmt: skip


def indivisible() -> str:
    """The refusal of 6 experts over ep=4 (pp1 x dp4)."""
    case = Case(1, 4, 1, 1, "1f1b", replace(MOE, experts=6))
    mesh = init_mesh(1, 4, ep=4, timeout=60)
    try:
        Pipeline(model(case), Partition.from_bounds((0, 7)), n_microbatches=2, loss_fn=GPTConfig.loss, mesh=mesh)
    except ValueError as err:
        return str(err)
    return "built"


def train_all(cases: list[Case]) -> dict[str, Any]:
    torch.set_num_threads(1)
    _recording_empty_experts()
    out = each_case(train, cases)
    out["indivisible"] = indivisible()
    dist.destroy_process_group()
    return out


LAYOUTS = [(2, 2, 1, 1), (2, 1, 2, 1), (1, 2, 1, 2)]
CASES = [Case(*layout, schedule) for layout in LAYOUTS for schedule in ("1f1b", "zero-bubble", "dualpipev")]
CASES += [
    Case(2, 2, 1, 1, "1f1b", replace(MOE, balancing="bias", bias_rate=0.01, scoring="sigmoid"), "-bias"),
    Case(2, 1, 2, 1, "zero-bubble", replace(MOE, capacity_factor=1.0, shared_experts=0), "-capacity"),
    Case(2, 2, 1, 1, "dualpipev", label="-one-at-a-time", overlap=False),  # the default
    Case(2, 2, 1, 1, "1f1b", label="-tied", tied=True),
]


@pytest.fixture(scope="module")
def outcomes() -> dict[int, dict[str, Any]]:
    """Every case on one launch of 4 processes: rank -> case name -> its results, or the traceback it raised."""
    per_rank: dict[int, dict[str, Any]] = run_ranks(train_all, 4, CASES, timeout=400)
    return per_rank


@pytest.mark.timeout(500)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_expert_parallel_pipelines_equal_the_unsplit_model(case: Case, outcomes: dict[int, dict[str, Any]]) -> None:
    want = unsplit(case)
    held: set[str] = set()
    experts: set[str] = set()
    empty, paired = False, 0
    for rank, results in outcomes.items():
        got = results[case.name]
        assert not isinstance(got, str), f"rank {rank}: {got}"
        torch.testing.assert_close(got["losses"], want["losses"], atol=1e-5, rtol=1e-5, msg=f"rank {rank}")
        torch.testing.assert_close(got["norms"], want["norms"], atol=1e-5, rtol=1e-5, msg=f"rank {rank}")
        torch.testing.assert_close(got["balance"], want["balance"], atol=1e-6, rtol=1e-5, msg=f"rank {rank}")
        for step in range(STEPS):
            assert set(got["grads"][step]) == set(got["params"]), f"rank {rank}: parameters without gradients"
            for name, grad in got["grads"][step].items():
                torch.testing.assert_close(grad, want["grads"][step][name], atol=1e-5, rtol=1e-5, msg=name)
        for name, param in got["params"].items():
            torch.testing.assert_close(param, want["params"][name], atol=1e-5, rtol=1e-5, msg=name)
        held |= set(got["params"])
        # Each rank holds half of each of its MoE layers' 8 experts.
        assert set(got["experts"].values()) <= {MOE.experts // 2}, got["experts"]
        experts |= set(got["experts"])
        empty |= got["empty"]
        paired += got["paired"]
    assert held == set(want["params"])
    # One norm on every rank: each replica counts every expert, not only its own.
    assert len({tuple(results[case.name]["norms"]) for results in outcomes.values()}) == 1, "the ranks' norms differ"
    assert experts == {n for n in want["params"] if ".experts." in n}, "every expert tensor is split"
    assert empty, "no expert went without tokens in any micro-batch: the case tests less than it says"
    # DualPipeV's forward and backward pairs run at once where their stages exchange tokens, without tp.
    assert (paired > 0) == (case.schedule == "dualpipev" and case.overlap and case.tp == 1), f"{paired} pairs"


def test_experts_that_ep_does_not_divide_are_refused_in_one_line(outcomes: dict[int, dict[str, Any]]) -> None:
    for results in outcomes.values():
        assert results["indivisible"] == (
            "blocks.1.moe has 6 experts, which ep=4 ranks cannot split evenly; choose ep among the divisors of 6, or "
            "a model with a multiple of 4 experts"
        )
