"""Checkpoints: any split loads into any other, exports to the unsplit model, and bad ones are refused."""

from __future__ import annotations

import dataclasses
import os
import pickle
import shutil
from collections.abc import Callable
from functools import partial
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from support.multiproc import run_ranks
from support.training import BASE, Runs, exported, launch_run

from stagewise import checkpoint
from stagewise.models import build
from stagewise.pipeline import Pipeline, materialise_model
from stagewise.run import build_pipeline, train


@pytest.mark.parametrize(("stages", "dp"), [(1, 1), (3, 1), (2, 2)])
def test_a_checkpoint_of_two_stages_resumes_with_other_splits(runs: Runs, stages: int, dp: int) -> None:
    root = runs.root
    here = root / f"s{stages}-dp{dp}"
    shutil.copytree(root / "half" / "step-00000004", here / "step-00000004")
    config = dataclasses.replace(BASE, pp=stages, dp=dp, stop_after=5, checkpoint_dir=str(here), resume=True)
    losses = launch_run(config)
    # The next step's loss equals continuing with 2 stages, so the parameters and optimizer state loaded equal.
    torch.testing.assert_close(losses[0], runs.whole[4], atol=1e-5, rtol=1e-5)
    got = exported(here, 5, here / "five.pt")
    want = dataclasses.replace(BASE, stop_after=5, checkpoint_dir=str(root / "five"))
    if not (root / "five").exists():
        launch_run(want)
    ref = exported(root / "five", 5, root / "five.pt")
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], atol=1e-5, rtol=1e-5, msg=name)


def test_a_checkpoint_of_one_stage_resumes_tied_weights_on_two(runs: Runs, tmp_path: Path) -> None:
    # One stage saves the tied embedding and head's optimizer state under the embedding's name only; the head's
    # copy on the second stage must find it there, or it restarts AdamW from nothing and the copies drift apart.
    one = dataclasses.replace(BASE, pp=1, stop_after=4, checkpoint_dir=str(tmp_path))
    torch.testing.assert_close(launch_run(one), runs.whole[:4], atol=1e-5, rtol=1e-5)
    two = dataclasses.replace(BASE, stop_after=6, checkpoint_dir=str(tmp_path), resume=True)
    torch.testing.assert_close(launch_run(two), runs.whole[4:6], atol=1e-5, rtol=1e-5)
    got = exported(tmp_path, 6, tmp_path / "six.pt")
    torch.testing.assert_close(got["head.weight"], got["embed.tokens.weight"], atol=0, rtol=0)


def test_the_export_loads_into_the_unsplit_model(runs: Runs) -> None:
    state = exported(runs.root / "half", 4, runs.root / "plain.pt")
    model = materialise_model(build("gpt-tiny-tied", device="meta"))
    model.load_state_dict(state)
    assert model.head.weight is model.embed.tokens.weight  # still tied after loading
    torch.testing.assert_close(model.head.weight, state["embed.tokens.weight"], atol=0, rtol=0)


def _refusal(action: Callable[[], object]) -> str:
    """The message of the :class:`CheckpointError` that ``action`` raises, or "accepted"."""
    try:
        action()
    except checkpoint.CheckpointError as err:
        return str(err)
    return "accepted"


def _broken_copies(saved: Path, base: Path) -> dict[str, Path]:
    """Copies of the checkpoint ``saved``: with corrupt metadata, a truncated data file, and code in its metadata."""
    copies = {case: base / case.replace(" ", "-") for case in ("corrupt", "truncated", "code in metadata")}
    for copy in copies.values():
        shutil.copytree(saved, copy)
    (copies["corrupt"] / ".metadata").write_bytes(b"\x80\x04not a pickle")
    data = next(p for p in copies["truncated"].iterdir() if p.suffix == ".distcp")
    data.write_bytes(data.read_bytes()[:100])
    (copies["code in metadata"] / ".metadata").write_bytes(pickle.dumps(os.system))
    return copies


def _load_refusals(saved: Path, base: Path, pipe: Pipeline) -> dict[str, str]:
    """Load ``saved`` (a 1-step checkpoint of :data:`BASE` on one stage) wrongly in every way: each message."""
    other = build_pipeline(dataclasses.replace(BASE, model="mlp-tiny", pp=1))
    messages = {
        "other model": _refusal(lambda: checkpoint.load(saved, other)),
        "no checkpoint": _refusal(lambda: checkpoint.load(base / "nowhere", other)),
        "other optimizer": _refusal(lambda: checkpoint.load(saved, pipe, torch.optim.SGD(pipe.parameters(), lr=0.1))),
    }
    for case, path in _broken_copies(saved, base).items():
        messages[case] = _refusal(partial(checkpoint.load, path, pipe))
    untied = dataclasses.replace(BASE, pp=1, stop_after=1, model="gpt-tiny", checkpoint_dir=str(base / "untied"))
    train(untied)
    untied_saved = checkpoint.latest(base / "untied")
    assert untied_saved is not None
    # the same keys, but two matrices where the tied model has one
    messages["untied into tied"] = _refusal(lambda: checkpoint.load(untied_saved, pipe))
    return messages


def _save_outcomes(base: Path, pipe: Pipeline) -> dict[str, str]:
    """Save beside a cut-off save and an older one, and into a file: what was left, and the refusal."""
    folder = base / "good"
    (folder / "step-00000009.partial").mkdir()  # a save cut off earlier
    kept = checkpoint.save(folder, pipe, None, checkpoint.Progress(0, 0, 0), keep=1)
    blocked = base / "blocked"
    blocked.write_text("a file where the checkpoint folder should be")
    return {
        "cut-off save left": str((folder / "step-00000009.partial").exists()),
        "older save kept": str(kept.is_dir()),  # the newest beside it must not rotate it away
        "unwritable": _refusal(lambda: checkpoint.save(blocked, pipe, None, checkpoint.Progress(1, 0, 0))),
    }


def bad_checkpoints(root: str) -> dict[str, str]:
    """Save one checkpoint, then load it wrongly in several ways and save beside it; what each did."""
    torch.set_num_threads(1)
    base = Path(root)
    train(dataclasses.replace(BASE, pp=1, stop_after=1, checkpoint_dir=str(base / "good")))
    saved = checkpoint.latest(base / "good")
    assert saved is not None
    pipe = build_pipeline(dataclasses.replace(BASE, pp=1))
    messages = _load_refusals(saved, base, pipe) | _save_outcomes(base, pipe)
    dist.destroy_process_group()
    return messages


def test_bad_checkpoints_are_refused_with_the_reason(tmp_path: Path) -> None:
    messages = run_ranks(bad_checkpoints, 1, str(tmp_path), timeout=120)[0]
    assert "does not fit this model: missing keys ['blocks.0.norm.bias'" in messages["other model"]
    assert "unexpected keys ['blocks.0.attn_norm.bias'" in messages["other model"]
    assert "is not a complete checkpoint: it has no .metadata" in messages["no checkpoint"]
    assert "is corrupt or truncated" in messages["corrupt"]
    assert messages["truncated"].endswith("failed (corrupt or truncated?): EOFError")
    assert "posix.system is not allowed in a checkpoint's metadata" in messages["code in metadata"]
    assert "rank 0 cannot write checkpoints to" in messages["unwritable"]
    ties = "holds different values for embed.tokens.weight, head.weight that this model ties into one"
    assert ties in messages["untied into tied"]
    assert messages["older save kept"] == "True"
    assert messages["cut-off save left"] == "False"
    assert messages["other optimizer"].endswith(
        "holds AdamW state, but the optimizer is SGD; resume with AdamW (stagewise train --optimizer adamw), "
        "or start afresh in another checkpoint directory"
    )
