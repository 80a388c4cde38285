"""Activation checkpointing (whole, selective, per layer) and activation offload equal the unsplit model, under
every kind of schedule: 1F1B, and the split backwards (zero-bubble, ZBV, DualPipeV) whose I and W each recompute.

One launch of 4 gloo processes (pp2 x dp2) runs every case, fp32, three AdamW steps with clipping, against the
unsplit model in one process; each case's outcome comes back on its own.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.distributed as dist
from support import gpt_steps
from support.gpt_steps import BATCH, CLIP, batches
from support.multiproc import run_ranks
from support.ops import Counted
from support.outcomes import each_case

from stagewise.comm import PipelineMesh, init_mesh
from stagewise.models.gpt import GPTConfig
from stagewise.partition import Partition, layers_of
from stagewise.pipeline import Compute, Pipeline, PipelineOptions, SelectiveCheckpointing
from stagewise.pipeline.stage.module import StageModule

Recompute = bool | SelectiveCheckpointing | str
"""A case's checkpointing: False, True, a SelectiveCheckpointing, or "per-layer" (:func:`per_layer`)."""


def per_layer(name: str) -> bool | SelectiveCheckpointing:
    """The embedding and the head keep everything, the first block recomputes all, the others selectively."""
    if name == "blocks.0":
        return True
    return SelectiveCheckpointing() if name.startswith("blocks.") else False


@dataclass(frozen=True)
class Case:
    schedule: str
    recompute: Recompute
    n_microbatches: int = 2
    offload: bool = False

    @property
    def n_virtual(self) -> int:
        return 2 if self.schedule in ("zbv", "dualpipev") else 1

    @property
    def compute(self) -> Compute:
        policy = per_layer if self.recompute == "per-layer" else self.recompute
        return Compute(activation_checkpointing=policy, offload_activations=self.offload)  # type: ignore[arg-type]

    @property
    def name(self) -> str:
        kinds: dict[object, str] = {False: "none", True: "full"}
        kind = "selective" if isinstance(self.recompute, SelectiveCheckpointing) else kinds.get(self.recompute)
        kind = kind or str(self.recompute)
        return f"{self.schedule}-m{self.n_microbatches}-{kind}{'-offload' if self.offload else ''}"


CASES = [
    Case("1f1b", SelectiveCheckpointing()),
    Case("zero-bubble", SelectiveCheckpointing(), n_microbatches=3),
    Case("zero-bubble", True),
    Case("zero-bubble", "per-layer"),
    Case("zbv", True),
    Case("zbv", SelectiveCheckpointing()),
    Case("dualpipev", True, n_microbatches=4),
    Case("1f1b", False, offload=True),
    Case("zero-bubble", SelectiveCheckpointing(), offload=True),
]
MESH: list[PipelineMesh] = []


def train(case: Case) -> dict[str, Any]:
    if not MESH:
        MESH.append(init_mesh(2, 2, timeout=60))
    mesh = MESH[0]
    bounds = (0, 2, 4, 5, 7) if case.n_virtual == 2 else (0, 3, 7)
    pipe = Pipeline(
        gpt_steps.model(tied=True), Partition.from_bounds(bounds), schedule=case.schedule,  # type: ignore[arg-type]
        n_microbatches=case.n_microbatches, loss_fn=GPTConfig.loss, mesh=mesh,  # type: ignore[arg-type]
        options=PipelineOptions(n_virtual=case.n_virtual, compute=case.compute),
    )  # fmt: skip
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-3)
    mine = mesh.share(BATCH)
    losses, norms = [], []
    for ids, targets in batches():
        opt.zero_grad()
        losses.append(pipe.step(ids[mine], targets[mine]).item())
        norms.append(float(pipe.clip_grad_norm_(CLIP)))
        opt.step()
    recomputing = [s.checkpointing for s in pipe._runtime.stages.values()]
    params = {n: p.detach().clone() for n, p in pipe.named_parameters()}
    pipe.close()
    return {"losses": losses, "norms": norms, "params": params, "recomputing": recomputing}


def train_all(cases: list[Case]) -> dict[str, Any]:
    torch.set_num_threads(1)
    out = each_case(train, cases)
    dist.destroy_process_group()
    return out


@pytest.fixture(scope="module")
def outcomes() -> dict[int, dict[str, Any]]:
    """Every case on one launch of 4 processes: rank -> case name -> its results, or the traceback it raised."""
    per_rank: dict[int, dict[str, Any]] = run_ranks(train_all, 4, CASES, timeout=300)
    return per_rank


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_recomputing_stages_equal_the_unsplit_model(case: Case, outcomes: dict[int, dict[str, Any]]) -> None:
    want = gpt_steps.unsplit(tied=True)
    for rank, results in outcomes.items():
        got = results[case.name]
        assert not isinstance(got, str), f"rank {rank}: {got}"
        torch.testing.assert_close(got["losses"], want["losses"], atol=1e-5, rtol=0, msg=f"rank {rank}")
        torch.testing.assert_close(got["norms"], want["norms"], atol=1e-5, rtol=0, msg=f"rank {rank}")
        for name, param in got["params"].items():
            torch.testing.assert_close(param, want["params"][name], atol=1e-5, rtol=0, msg=name)
        # Every stage recomputes (the per-layer policy too: each stage holds a block), unless none was asked for.
        assert all(got["recomputing"]) == bool(case.recompute), f"rank {rank}: {got['recomputing']}"


def _backward_ops(checkpointing: Any) -> Counter[str]:
    """The ops the backward of a stage of a small GPT's four blocks runs, its recomputation included."""
    torch.manual_seed(0)
    model = GPTConfig(vocab_size=16, seq_len=8, d_model=16, n_layers=4, n_heads=2).build()
    layers = [layer for layer in layers_of(model) if layer.name.startswith("blocks.")]
    stage = StageModule(0, 1, layers, compute=Compute(activation_checkpointing=checkpointing))
    x = torch.randn(2, 8, 16, requires_grad=True)
    out = stage.run(x)
    assert isinstance(out, torch.Tensor)
    counted = Counted()
    with counted:
        out.square().sum().backward()
    return counted.ops


def test_a_per_layer_policy_recomputes_the_layers_it_names_and_only_those() -> None:
    gelu = "aten.gelu.default"  # one per block's forward, recomputed by whole and selective checkpointing alike
    assert _backward_ops(False)[gelu] == 0
    assert _backward_ops(True)[gelu] == 4
    assert _backward_ops(lambda name: name in ("blocks.1", "blocks.3"))[gelu] == 2


def test_a_per_layer_policy_that_returns_something_else_is_refused() -> None:
    compute = Compute(activation_checkpointing=lambda name: "selective")  # type: ignore[arg-type,return-value]
    with pytest.raises(TypeError, match=r"^Compute.activation_checkpointing\('blocks.0'\) returned 'selective'"):
        compute.checkpointing_of("blocks.0")
