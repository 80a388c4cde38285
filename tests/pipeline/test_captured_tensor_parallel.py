"""Tensor parallelism of captured Hugging Face models, by a path-keyed plan, equals the unsplit model.

One launch of 4 gloo processes trains every case for 3 steps: Llama (its config's own ``tp_plan``, "model") with
SDPA attention at pp2 x tp2 and with eager attention at fsdp2 x tp2, GPT-2 (a mapping: its config has no plan,
and its ``Conv1D`` weights are stored ``[in, out]``) at pp2 x tp2 with its tied head, loaded from pretrained
weights, and stagewise's GPT (uncaptured modules) by a mapping. Each case's losses and whole parameters are
compared with one process; the refusals run in this process.
"""

from __future__ import annotations

import functools
import logging
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import pytest
import torch
import torch.distributed as dist
import transformers
from support import gpt_steps
from support.hf import Kind, batch, config, lm_loss, steps, train_unsplit
from support.multiproc import run_ranks
from support.outcomes import each_case
from torch import nn
from torch.distributed.tensor import DTensor

from stagewise.comm import PipelineMesh, init_mesh
from stagewise.models.gpt import GPTConfig
from stagewise.partition import Partition, capture, layers_of, shared_parameters
from stagewise.pipeline import Pipeline, PipelineOptions, load_pretrained, materialise_model
from stagewise.pipeline.parallel.captured_tensor_parallel import check_ties, segment_split
from stagewise.pipeline.parallel.tensor_plan import TensorPlanError, parameter_names, path_plan
from stagewise.pipeline.pretrained import write_weights

log = logging.getLogger(__name__)

SEED = 5
WEIGHTS_SEED = 11
"""The seed of the weights GPT-2 loads (not the pipeline's own initialisation)."""
BATCH = 4
MICRO = 2
LENGTHS = (16, 12, 20)
"""Captured at the first length; the steps run at each."""
LR = 0.5

GPT2_PLAN = {
    "transformer.wte": "embedding_rowwise",
    "lm_head": "colwise_rep",
    "transformer.h.*.attn.c_attn": "colwise",
    "transformer.h.*.attn.c_proj": "rowwise",
    "transformer.h.*.mlp.c_fc": "colwise",
    "transformer.h.*.mlp.c_proj": "rowwise",
}
GPT_PLAN = {
    "embed.tokens": "embedding_rowwise",
    "blocks.*.qkv": "colwise",
    "blocks.*.proj": "rowwise",
    "blocks.*.fc": "colwise",
    "blocks.*.out": "rowwise",
    "head": "colwise_rep",
}


@dataclass(frozen=True)
class Case:
    name: str
    kind: Kind | Literal["gpt"]
    attention: Literal["sdpa", "eager"]
    pp: int
    fsdp: int
    plan: Any
    split: str
    """A parameter the plan splits over the tp ranks (each holds a 1/tp share of it, and 1/fsdp of that)."""
    pretrained: bool = False


CASES = [
    Case("llama-sdpa-pp2-tp2", "llama", "sdpa", 2, 1, "model", "model.layers.1.self_attn.k_proj.weight"),
    Case("llama-eager-fsdp2-tp2", "llama", "eager", 1, 2, "model", "lm_head.weight"),
    Case("gpt2-pp2-tp2-pretrained", "gpt2", "sdpa", 2, 1, GPT2_PLAN, "transformer.h.0.attn.c_attn.weight", True),
    Case("gpt-mapping-pp2-tp2", "gpt", "sdpa", 2, 1, GPT_PLAN, "blocks.0.fc.weight"),
]


def hf_model(kind: Kind, attention: str, *, meta: bool) -> nn.Module:
    """A tiny causal LM of ``kind`` with ``attention``, for training."""
    cfg = config(kind)
    cfg._attn_implementation = attention
    cls = transformers.LlamaForCausalLM if kind == "llama" else transformers.GPT2LMHeadModel
    if meta:
        with torch.device("meta"):
            return cls(cfg).train()
    return cls(cfg).train()


def initialised(kind: Kind, attention: str, seed: int) -> nn.Module:
    """The model itself (not its capture), initialised as a pipeline's layers are from ``seed``."""
    model = hf_model(kind, attention, meta=True)
    materialise_model(capture(model, batch(MICRO, LENGTHS[0], seed=0)), seed=seed)
    return model


def unsplit(case: Case) -> dict[str, Any]:
    """The unsplit model's losses over :func:`steps` of SGD, and its state after them, in one process."""
    if case.kind == "gpt":
        want = gpt_steps.unsplit(tied=False)
        return {"losses": want["losses"], "state": {k: v.detach() for k, v in want["params"].items()}}
    model = initialised(case.kind, case.attention, WEIGHTS_SEED if case.pretrained else SEED)
    return train_unsplit(model, steps(BATCH, LENGTHS), lr=LR)


def _whole(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


MESHES: dict[tuple[int, int], PipelineMesh] = {}


def _pipeline(case: Case, mesh: PipelineMesh) -> Pipeline:
    if case.kind == "gpt":
        return Pipeline(
            gpt_steps.model(tied=False), Partition.from_bounds((0, 3, 7)), n_microbatches=2, loss_fn=GPTConfig.loss,
            mesh=mesh, options=PipelineOptions(tensor_parallel=case.plan),
        )  # fmt: skip
    chain = capture(hf_model(case.kind, case.attention, meta=True), batch(MICRO, LENGTHS[0], seed=0))
    bounds = (0, 2, 4) if case.pp == 2 else (0, 4)
    pipe = Pipeline(
        chain, Partition.from_bounds(bounds), n_microbatches=MICRO, loss_fn=lm_loss, mesh=mesh,
        options=PipelineOptions(seed=SEED, tensor_parallel=case.plan),
    )  # fmt: skip
    if case.pretrained:
        with tempfile.TemporaryDirectory() as folder:
            state = initialised(case.kind, case.attention, WEIGHTS_SEED).state_dict()
            del state["lm_head.weight"]  # stored once, as Hugging Face stores a tied head
            path = write_weights(state, Path(folder) / "w.safetensors")
            load_pretrained(pipe, path)
    return pipe


def _train(pipe: Pipeline, case: Case, mesh: PipelineMesh) -> list[float]:
    if case.kind == "gpt":
        opt: torch.optim.Optimizer = torch.optim.AdamW(pipe.parameters(), lr=1e-3)
        mine = mesh.share(gpt_steps.BATCH)
        losses = []
        for ids, targets in gpt_steps.batches():
            opt.zero_grad()
            losses.append(pipe.step(ids[mine], targets[mine]).item())
            pipe.clip_grad_norm_(gpt_steps.CLIP)
            opt.step()
        return losses
    opt = torch.optim.SGD(pipe.parameters(), lr=LR)
    mine = mesh.share(BATCH)
    losses = []
    for inputs, targets in steps(BATCH, LENGTHS):
        opt.zero_grad()
        losses.append(pipe.step({k: v[mine] for k, v in inputs.items()}, targets[mine]).item())
        opt.step()
    return losses


def train(case: Case) -> dict[str, Any]:
    layout = (case.pp, case.fsdp)
    if layout not in MESHES:
        MESHES[layout] = init_mesh(case.pp, 1, fsdp=case.fsdp, tp=2, timeout=90)
    mesh = MESHES[layout]
    start = time.perf_counter()
    pipe = _pipeline(case, mesh)
    losses = _train(pipe, case, mesh)
    log.warning("%s took %.1f s", case.name, time.perf_counter() - start)
    params = dict(pipe.named_parameters())
    placed = all(p.grad.placements == p.placements for p in params.values() if isinstance(p, DTensor))
    shares = {n: p.numel() // p.to_local().numel() for n, p in params.items() if isinstance(p, DTensor)}
    state = {k: _whole(v) for k, v in pipe.state_dict().items()}
    pipe.close()
    return {"losses": losses, "state": state, "placed": placed, "shares": shares}


def train_all(cases: list[Case]) -> dict[str, Any]:
    torch.set_num_threads(1)
    out = each_case(train, cases)
    dist.destroy_process_group()
    return out


@pytest.fixture(scope="module")
def outcomes() -> dict[int, dict[str, Any]]:
    """Every case on one launch of 4 processes: rank -> case name -> its results, or the traceback it raised."""
    per_rank: dict[int, dict[str, Any]] = run_ranks(train_all, 4, CASES, timeout=400)
    return per_rank


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_captured_models_split_over_tp_ranks_equal_the_unsplit_model(
    case: Case, outcomes: dict[int, dict[str, Any]]
) -> None:
    want = unsplit(case)
    merged: dict[str, torch.Tensor] = {}
    for rank, results in outcomes.items():
        got = results[case.name]
        assert not isinstance(got, str), f"rank {rank}: {got}"
        torch.testing.assert_close(got["losses"], want["losses"], atol=1e-5, rtol=1e-5, msg=f"rank {rank}")
        assert got["placed"], f"rank {rank}: a gradient is placed unlike its parameter"
        if case.split in got["shares"]:
            assert got["shares"][case.split] == 2 * case.fsdp, (rank, got["shares"])  # split over tp (and fsdp)
        merged.update(got["state"])
    assert any(case.split in results[case.name]["shares"] for results in outcomes.values())
    assert sorted(merged) == sorted(want["state"])
    for name, value in want["state"].items():
        torch.testing.assert_close(merged[name], value, atol=1e-5, rtol=1e-5, msg=f"{case.name}: {name}")


@functools.cache
def _llama_layers() -> tuple[Any, list[Any]]:
    chain = capture(hf_model("llama", "sdpa", meta=True), batch(MICRO, LENGTHS[0], seed=0))
    return chain, layers_of(chain)


def test_a_plan_key_that_names_nothing_is_refused_in_one_line() -> None:
    chain, layers = _llama_layers()
    plan = path_plan({"model.layers.*.attn.q": "colwise"}, chain)
    with pytest.raises(
        TensorPlanError, match=r"^PipelineOptions.tensor_parallel key 'model.layers.\*.attn.q' names no"
    ):
        plan.check_names(parameter_names(layers))


def test_a_dimension_tp_does_not_divide_is_refused_with_the_degrees_that_fit() -> None:
    chain, layers = _llama_layers()
    plan = path_plan("model", chain)
    with pytest.raises(
        TensorPlanError,
        match=r"^tp=3 does not divide dimension 0 \(size 32\) of model.layers.0.self_attn.q_proj.weight, which "
        r"LlamaForCausalLM's tp_plan splits; choose tp among \[1, 2, 4, 8, 16, 32\], or map it to 'replicate'$",
    ):
        segment_split(layers[1].module, layers[1].name, plan, 3)


def test_an_unknown_style_is_refused_naming_the_accepted_ones() -> None:
    with pytest.raises(ValueError, match=r"^PipelineOptions.tensor_parallel maps 'lm_head' to 'packed_colwise', which"):
        PipelineOptions(tensor_parallel={"lm_head": "packed_colwise"})  # type: ignore[dict-item]
    with pytest.raises(TypeError, match=r"^PipelineOptions.tensor_parallel must be callable"):
        PipelineOptions(tensor_parallel=3)  # type: ignore[arg-type]


def test_a_model_without_a_tp_plan_is_refused_for_the_model_plan() -> None:
    with pytest.raises(TensorPlanError, match=r"^PipelineOptions.tensor_parallel='model', but GPT2LMHeadModel has no"):
        path_plan("model", hf_model("gpt2", "sdpa", meta=True))


def test_a_tied_weight_split_unalike_by_its_modules_is_refused() -> None:
    chain = capture(hf_model("gpt2", "sdpa", meta=True), batch(MICRO, LENGTHS[0], seed=0))
    layers = layers_of(chain)
    tied = shared_parameters(layers)
    for head, agree in (("colwise", True), ("rowwise", False)):  # the embedding's rows; the head's rows or columns
        plan = path_plan({"transformer.wte": "embedding_rowwise", "lm_head": head}, chain)
        splits = {i: segment_split(layer.module, layer.name, plan, 2) for i, layer in enumerate(layers)}
        if agree:
            check_ties(layers, tied, splits)
            continue
        with pytest.raises(TensorPlanError, match=r"^the tied parameter transformer.wte.weight is split unalike"):
            check_ties(layers, tied, splits)


def test_train_splits_a_hugging_face_folder_by_its_config_plan_and_refuses_one_without(tmp_path: Path) -> None:
    from stagewise.run import TrainConfig
    from stagewise.run.job_pipeline import pipeline_options, preflight

    for kind in ("llama", "gpt2"):
        settings = config(kind, layers=2)
        settings.vocab_size = 256  # the bytes tokenizer's
        transformers.AutoModelForCausalLM.from_config(settings).save_pretrained(tmp_path / kind)
    llama = TrainConfig(model=f"hf:{tmp_path / 'llama'}", tokenizer="bytes", pp=1, tp=2, seq_len=32, batch_size=4)
    preflight(llama)  # the config's plan splits every captured layer two ways
    assert pipeline_options(llama).tensor_parallel == "model"
    gpt2 = TrainConfig(model=f"hf:{tmp_path / 'gpt2'}", tokenizer="bytes", pp=1, tp=2, seq_len=32, batch_size=4)
    with pytest.raises(TensorPlanError, match=r"^PipelineOptions.tensor_parallel='model', but GPT2LMHeadModel has no"):
        preflight(gpt2)
