"""Mixture-of-experts checkpoints across expert parallelism, and the experts' memory per rank.

One launch of 4 gloo processes:

- the training job (:func:`stagewise.run.train`) trains ``gpt-moe-tiny`` for 3 steps at pp2 x dp2 with ep=2,
  checkpointing at step 2; copies of that checkpoint resume at ep=1 (pp2 x dp2), ep=4 (pp1 x dp4) and ep=2 over
  FSDP (pp1 x fsdp4: 2 ep groups x 2), and at its own layout; each resumed run's step 3 is the uninterrupted run's;
- the step-2 checkpoint exported whole: the unsplit model's full expert tensors, the same as the ranks' DTensors
  gathered, and that model's loss (language model + balance loss) the pipeline's;
- at ep = 1, 2, 4 (pp1 x dp4) each rank's bytes of expert parameters and of their AdamW state after a step:
  1/ep of the model's, exactly;
- a routing bias (``balancing="bias"``, a buffer) moved by a step at ep=2 and loaded at ep=4.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import shutil
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from support.multiproc import run_ranks
from torch.distributed.tensor import DTensor

from stagewise import checkpoint
from stagewise.models import PRESETS, GPTConfig
from stagewise.models.moe import Experts, auxiliary_loss
from stagewise.pipeline import Pipeline
from stagewise.run import TrainConfig, build_pipeline, train

MODEL = "gpt-moe-tiny"
BIASED = "gpt-moe-tiny-bias"
"""``gpt-moe-tiny`` balanced by routing bias: registered in the ranks' processes only (see :func:`_register`)."""
BASE = TrainConfig(
    model=MODEL, pp=2, dp=2, ep=2, microbatches=2, batch_size=8, seq_len=16, steps=3, warmup=1,
    eval_every=0, eval_batches=1, data_limit=256 * 1024, timeout=60,
)  # fmt: skip
SAVED_AT = 2
LAYOUTS = {
    "pp2xdp2-ep1": dataclasses.replace(BASE, ep=1),
    "pp1xdp4-ep4": dataclasses.replace(BASE, pp=1, dp=4, ep=4),
    "pp1xfsdp4-ep2": dataclasses.replace(BASE, pp=1, dp=1, fsdp=4, ep=2),
    "pp2xdp2-ep2": BASE,
}
"""Where the ep=2 checkpoint resumes: without expert parallelism, over all 4 ranks, and over FSDP's shards."""
EPS = (1, 2, 4)
WORLD = 4


def _register() -> None:
    """Add :data:`BIASED` to this process's presets (a rank's, forked for this job alone)."""
    tiny = PRESETS[MODEL]
    assert isinstance(tiny, GPTConfig) and tiny.moe is not None
    PRESETS[BIASED] = dataclasses.replace(tiny, moe=dataclasses.replace(tiny.moe, balancing="bias"))


def _batch(config: TrainConfig, pipe: Pipeline) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A global batch of token ids, its targets, and this rank's share's slice as a mask-free pair."""
    g = torch.Generator().manual_seed(11)
    ids = torch.randint(0, 256, (config.batch_size, config.seq_len), generator=g)
    return ids, torch.roll(ids, -1, dims=1), torch.arange(config.batch_size)[pipe.mesh.share(config.batch_size)]


def _guarded(out: dict[str, Any], key: str, fn: Callable[[], Any]) -> None:
    """``out[key] = fn()``, or the traceback, which the case's own test reports."""
    try:
        out[key] = fn()
    except Exception:
        out[key] = traceback.format_exc()


def _resumed(root: Path, name: str, config: TrainConfig) -> list[float]:
    """Resume a copy of the ep=2 run's step-2 checkpoint in ``config``'s layout; its losses."""
    folder = root / name
    if dist.get_rank() == 0:
        shutil.copytree(root / "saved" / f"step-{SAVED_AT:08d}", folder / f"step-{SAVED_AT:08d}")
    dist.barrier()
    return train(dataclasses.replace(config, checkpoint_dir=str(folder), resume=True)).losses


def _experts_whole(pipe: Pipeline) -> dict[str, torch.Tensor]:
    """Every expert tensor and routing bias this rank's stages hold, gathered whole, by its unsplit name."""
    return {
        name: (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()
        for name, t in pipe.state_dict().items()
        if ".experts." in name or name.endswith("expert_bias")
    }


def _local_bytes(t: torch.Tensor) -> int:
    local = t.to_local() if isinstance(t, DTensor) else t
    return local.numel() * local.element_size()


def _memory(pipe: Pipeline, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """This rank's bytes of expert parameters and of their optimizer state (``step`` apart: one scalar each)."""
    named = dict(pipe.named_parameters())
    experts = [p for n, p in named.items() if ".experts." in n]
    others = [p for n, p in named.items() if ".experts." not in n]
    state = [optimizer.state[p] for p in experts]
    return {
        "expert_params": sum(_local_bytes(p) for p in experts),
        "expert_state": sum(_local_bytes(v) for s in state for k, v in s.items() if k != "step"),
        "expert_steps": sum(_local_bytes(s["step"]) for s in state),
        "other_params": sum(_local_bytes(p) for p in others),
    }


def _at_ep(ep: int, saved: Path, exported: Path) -> dict[str, Any]:
    """The step-2 checkpoint loaded at pp1 x dp4 with ``ep``: its experts gathered, the loss of a step and of an
    evaluation of the same batch (the first has the balance loss), the unsplit model's from the export; then the
    bytes this rank holds after the AdamW step."""
    config = dataclasses.replace(BASE, pp=1, dp=4, ep=ep)
    pipe = build_pipeline(config)
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=1e-3, weight_decay=0.01)
    checkpoint.load(saved, pipe, optimizer)
    out: dict[str, Any] = {"experts": _experts_whole(pipe)}
    ids, targets, mine = _batch(config, pipe)
    out["evaluated"] = pipe.evaluate(ids[mine], targets[mine]).item()
    optimizer.zero_grad()
    out["stepped"] = pipe.step(ids[mine], targets[mine]).item()
    optimizer.step()
    out["memory"] = _memory(pipe, optimizer)
    if ep == 1 and dist.get_rank() == 0:
        model = PRESETS[MODEL].build()
        model.load_state_dict(torch.load(exported, weights_only=True))
        with torch.no_grad():
            lm = GPTConfig.loss(model(ids), targets).item()
        out["unsplit"] = {"lm": lm, "balance": float(auxiliary_loss(model))}
        out["unsplit_experts"] = {k: v for k, v in model.state_dict().items() if k in out["experts"]}
    pipe.close()
    return out


def _bias_moves_across_ep(root: Path) -> dict[str, Any]:
    """A routing bias moved by one step at ep=2 (pp1 x dp4), saved, and loaded at ep=4: each layer's bias there."""
    _register()
    config = dataclasses.replace(BASE, model=BIASED, pp=1, dp=4, ep=2)
    pipe = build_pipeline(config)
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=1e-3)
    ids, targets, mine = _batch(config, pipe)
    pipe.step(ids[mine], targets[mine])
    optimizer.step()
    before = {n: t.clone() for n, t in pipe.state_dict().items() if n.endswith("expert_bias")}
    saved = checkpoint.save(root / "biased", pipe, optimizer, checkpoint.Progress(1, 0, 0))
    pipe.close()
    other = build_pipeline(dataclasses.replace(config, ep=4))
    checkpoint.load(saved, other)
    after = {n: t.clone() for n, t in other.state_dict().items() if n.endswith("expert_bias")}
    other.close()
    return {"before": before, "after": after}


def job(root: Path) -> dict[str, Any]:
    """Every case's result on this rank (see the module's docstring)."""
    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    whole = dataclasses.replace(
        BASE, checkpoint_dir=str(root / "saved"), checkpoint_every=SAVED_AT, metrics=str(root / "metrics.jsonl")
    )
    out["uninterrupted"] = train(whole).losses
    if dist.get_rank() == 0:
        out["metrics"] = [json.loads(line) for line in (root / "metrics.jsonl").read_text().splitlines()]
    for name, config in LAYOUTS.items():
        _guarded(out, name, functools.partial(_resumed, root, name, config))
    saved = root / "saved" / f"step-{SAVED_AT:08d}"
    exported = root / "unsplit.pt"
    if dist.get_rank() == 0:
        checkpoint.export(saved, exported)
    dist.barrier()
    for ep in EPS:
        _guarded(out, f"ep{ep}", functools.partial(_at_ep, ep, saved, exported))
    _guarded(out, "bias", functools.partial(_bias_moves_across_ep, root))
    dist.destroy_process_group()
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, Any]]:
    root = tmp_path_factory.mktemp("experts")
    per_rank: dict[int, dict[str, Any]] = run_ranks(job, WORLD, root, timeout=300)
    return per_rank


def _each(results: dict[int, dict[str, Any]], key: str) -> dict[int, Any]:
    values = {rank: out[key] for rank, out in results.items()}
    for rank, value in values.items():
        assert not isinstance(value, str), f"rank {rank}: {value}"
    return values


def _agreed(results: dict[int, dict[str, Any]], key: str) -> Any:
    values = list(_each(results, key).values())
    assert all(v == values[0] for v in values), values  # every rank reports the global batch's loss
    return values[0]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_an_ep2_checkpoint_resumes_in_another_ep_with_the_same_next_loss(
    results: dict[int, dict[str, Any]], layout: str
) -> None:
    uninterrupted = _agreed(results, "uninterrupted")
    assert len(uninterrupted) == BASE.steps
    resumed = _agreed(results, layout)
    assert len(resumed) == BASE.steps - SAVED_AT
    assert resumed[0] == pytest.approx(uninterrupted[SAVED_AT], abs=1e-5)


def test_the_run_reports_the_balance_loss_inside_its_loss(results: dict[int, dict[str, Any]]) -> None:
    steps = [record for record in results[0]["metrics"] if "balance_loss" in record]
    assert [record["step"] for record in steps] == [1, 2, 3]
    assert all(0 < record["balance_loss"] < record["loss"] for record in steps), steps


def test_an_ep2_checkpoint_resumes_bit_for_bit_in_its_own_layout(results: dict[int, dict[str, Any]]) -> None:
    assert _agreed(results, "pp2xdp2-ep2")[0] == _agreed(results, "uninterrupted")[SAVED_AT]


def test_the_export_holds_the_unsplit_models_full_experts_and_loss(results: dict[int, dict[str, Any]]) -> None:
    at_ep1 = _each(results, "ep1")
    unsplit = at_ep1[0]["unsplit"]
    full = at_ep1[0]["unsplit_experts"]
    tiny = PRESETS[MODEL]
    assert isinstance(tiny, GPTConfig) and tiny.moe is not None
    stacked = [n for n in full if n.endswith((".gate", ".up", ".down"))]
    assert len(stacked) == 3 * (tiny.n_layers - tiny.moe.dense_layers)
    assert all(full[n].shape[0] == tiny.moe.experts for n in stacked)
    assert unsplit["balance"] > 0
    for ep in EPS:
        per_rank = _each(results, f"ep{ep}")
        held = {name: t for out in per_rank.values() for name, t in out["experts"].items()}
        assert held.keys() == full.keys(), ep  # pp1: every rank holds every layer
        for name, t in held.items():
            torch.testing.assert_close(t, full[name], atol=0, rtol=0, msg=f"ep={ep} {name}")
        evaluated = _agreed({r: {"v": o["evaluated"]} for r, o in per_rank.items()}, "v")
        stepped = _agreed({r: {"v": o["stepped"]} for r, o in per_rank.items()}, "v")
        assert evaluated == pytest.approx(unsplit["lm"], abs=1e-5), ep
        assert stepped == pytest.approx(unsplit["lm"] + unsplit["balance"], abs=1e-5), ep  # with the balance loss


def test_each_rank_holds_one_ep_th_of_the_experts_and_their_optimizer_state(
    results: dict[int, dict[str, Any]],
) -> None:
    model = PRESETS[MODEL].build(device="meta")
    experts = [p for m in model.modules() if isinstance(m, Experts) for p in m.parameters()]
    whole = sum(p.numel() * p.element_size() for p in experts)
    for ep in EPS:
        for rank, out in _each(results, f"ep{ep}").items():
            memory = out["memory"]
            assert memory["expert_params"] * ep == whole, (ep, rank, memory)
            assert memory["expert_state"] * ep == 2 * whole, (ep, rank, memory)  # AdamW: exp_avg, exp_avg_sq
            assert memory["expert_steps"] == len(experts) * 4, (ep, rank, memory)  # one float32 step each


def test_a_routing_bias_moves_with_its_checkpoint_across_ep(results: dict[int, dict[str, Any]]) -> None:
    for rank, out in _each(results, "bias").items():
        before, after = out["before"], out["after"]
        assert before.keys() == after.keys() and before, rank
        assert any(bool(t.abs().sum() > 0) for t in before.values()), rank  # the step moved it
        for name in before:
            assert torch.equal(before[name], after[name]), (rank, name)


def test_expert_parallelism_of_a_model_without_experts_is_refused_before_any_process() -> None:
    from stagewise.run.job_pipeline import preflight

    with pytest.raises(ValueError, match=r"ep=2 splits mixture-of-experts layers' experts over ranks, but gpt-tiny"):
        preflight(dataclasses.replace(BASE, model="gpt-tiny"))
    with pytest.raises(ValueError, match=r"ep=3 does not divide the 8 experts of gpt-moe-tiny's .* divisors of 8"):
        preflight(dataclasses.replace(BASE, pp=1, dp=3, ep=3, batch_size=6))
