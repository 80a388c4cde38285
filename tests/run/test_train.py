"""The training job: resume is exact, checkpoints reshard to other stage counts and dp, and bad ones are refused."""

from __future__ import annotations

import dataclasses
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from support.multiproc import run_ranks

from stagewise import checkpoint
from stagewise.comm import LaunchError
from stagewise.models import build
from stagewise.pipeline import WeightGradientFusion, materialise_model
from stagewise.run import TrainConfig, build_pipeline, train

BASE = TrainConfig(
    model="gpt-tiny-tied",
    stages=2,
    microbatches=2,
    batch_size=8,
    seq_len=32,
    steps=8,
    warmup=2,
    eval_every=0,
    eval_batches=1,
    timeout=60,
)


def run(config: TrainConfig) -> list[float]:
    torch.set_num_threads(1)
    return train(config).losses


def launch_run(config: TrainConfig) -> list[float]:
    return run_ranks(run, config.world_size, config, timeout=180)[0]


def exported(directory: Path, step: int, into: Path) -> dict[str, torch.Tensor]:
    out = checkpoint.export(directory / f"step-{step:08d}", into)
    return torch.load(out, weights_only=True)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """An uninterrupted 8-step run, and a 4-step run whose checkpoint the tests resume from."""
    root = tmp_path_factory.mktemp("train")
    whole = dataclasses.replace(BASE, checkpoint_dir=str(root / "whole"), checkpoint_every=4)
    half = dataclasses.replace(BASE, stop_after=4, checkpoint_dir=str(root / "half"))
    return {"root": root, "whole": launch_run(whole), "half": launch_run(half)}


def test_resume_continues_bitwise_exactly(runs: dict[str, Any]) -> None:
    root: Path = runs["root"]
    config = dataclasses.replace(BASE, checkpoint_dir=str(root / "half"), resume=True)
    rest = launch_run(config)
    assert runs["half"] + rest == runs["whole"]  # the same losses, bit for bit
    a = exported(root / "whole", 8, root / "a.pt")
    b = exported(root / "half", 8, root / "b.pt")
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    assert runs["whole"][-1] < runs["whole"][0]


@pytest.mark.parametrize(("stages", "dp"), [(1, 1), (3, 1), (2, 2)])
def test_a_checkpoint_of_two_stages_resumes_with_other_splits(runs: dict[str, Any], stages: int, dp: int) -> None:
    root: Path = runs["root"]
    here = root / f"s{stages}-dp{dp}"
    shutil.copytree(root / "half" / "step-00000004", here / "step-00000004")
    config = dataclasses.replace(BASE, stages=stages, dp=dp, stop_after=5, checkpoint_dir=str(here), resume=True)
    losses = launch_run(config)
    # The next step's loss equals continuing with 2 stages, so the parameters and optimizer state loaded equal.
    torch.testing.assert_close(losses[0], runs["whole"][4], atol=1e-5, rtol=1e-5)
    got = exported(here, 5, here / "five.pt")
    want = dataclasses.replace(BASE, stop_after=5, checkpoint_dir=str(root / "five"))
    if not (root / "five").exists():
        launch_run(want)
    ref = exported(root / "five", 5, root / "five.pt")
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], atol=1e-5, rtol=1e-5, msg=name)


def test_a_checkpoint_of_one_stage_resumes_tied_weights_on_two(runs: dict[str, Any], tmp_path: Path) -> None:
    # One stage saves the tied embedding and head's optimizer state under the embedding's name only; the head's
    # copy on the second stage must find it there, or it restarts AdamW from nothing and the copies drift apart.
    root: Path = runs["root"]
    one = dataclasses.replace(BASE, stages=1, stop_after=4, checkpoint_dir=str(tmp_path))
    torch.testing.assert_close(launch_run(one), runs["whole"][:4], atol=1e-5, rtol=1e-5)
    two = dataclasses.replace(BASE, stop_after=6, checkpoint_dir=str(tmp_path), resume=True)
    torch.testing.assert_close(launch_run(two), runs["whole"][4:6], atol=1e-5, rtol=1e-5)
    got = exported(tmp_path, 6, tmp_path / "six.pt")
    torch.testing.assert_close(got["head.weight"], got["embed.tokens.weight"], atol=0, rtol=0)
    want = dataclasses.replace(BASE, stop_after=6, checkpoint_dir=str(root / "six"))
    launch_run(want)
    ref = exported(root / "six", 6, root / "six.pt")
    for name in ref:  # AdamW's normalised step magnifies rounding on small gradients (biases: 1.6e-5 after 6 steps)
        torch.testing.assert_close(got[name], ref[name], atol=1e-4, rtol=1e-4, msg=name)


def test_the_export_loads_into_the_unsplit_model(runs: dict[str, Any]) -> None:
    root: Path = runs["root"]
    state = exported(root / "half", 4, root / "plain.pt")
    model = materialise_model(build("gpt-tiny-tied", device="meta"))
    model.load_state_dict(state)
    assert model.head.weight is model.embed.tokens.weight  # still tied after loading
    torch.testing.assert_close(model.head.weight, state["embed.tokens.weight"], atol=0, rtol=0)


def bad_checkpoints(root: str) -> dict[str, str]:
    """Save one checkpoint, then load it wrongly in several ways; the error message of each."""
    torch.set_num_threads(1)
    base = Path(root)
    config = dataclasses.replace(BASE, stages=1, stop_after=1, checkpoint_dir=str(base / "good"))
    train(config)
    saved = checkpoint.latest(base / "good")
    assert saved is not None
    messages: dict[str, str] = {}
    other = build_pipeline(dataclasses.replace(BASE, model="mlp-tiny", stages=1))
    for case, action in {
        "other model": lambda: checkpoint.load(saved, other),
        "no checkpoint": lambda: checkpoint.load(base / "nowhere", other),
    }.items():
        try:
            action()
        except checkpoint.CheckpointError as err:
            messages[case] = str(err)
    pipe = build_pipeline(dataclasses.replace(BASE, stages=1))
    corrupt = base / "corrupt"
    shutil.copytree(saved, corrupt)
    (corrupt / ".metadata").write_bytes(b"\x80\x04not a pickle")
    truncated = base / "truncated"
    shutil.copytree(saved, truncated)
    data = next(p for p in truncated.iterdir() if p.suffix == ".distcp")
    data.write_bytes(data.read_bytes()[:100])
    evil = base / "evil"
    shutil.copytree(saved, evil)
    import pickle

    (evil / ".metadata").write_bytes(pickle.dumps(os.system))
    try:
        checkpoint.load(saved, pipe, torch.optim.SGD(pipe.parameters(), lr=0.1))
    except checkpoint.CheckpointError as err:
        messages["other optimizer"] = str(err)
    for case, path in {"corrupt": corrupt, "truncated": truncated, "code in metadata": evil}.items():
        try:
            checkpoint.load(path, pipe)
        except checkpoint.CheckpointError as err:
            messages[case] = str(err)
    untied = dataclasses.replace(config, model="gpt-tiny", checkpoint_dir=str(base / "untied"))
    train(untied)
    try:  # the same keys, but two matrices where the tied model has one
        checkpoint.load(checkpoint.latest(base / "untied"), pipe)  # type: ignore[arg-type]
    except checkpoint.CheckpointError as err:
        messages["untied into tied"] = str(err)
    try:  # a fresh run into the folder of an earlier one would mix the two runs' checkpoints
        train(config)
    except ValueError as err:
        messages["fresh run into a used folder"] = str(err)
    try:  # the data position counts batches: another batch size would skip or reread samples
        train(dataclasses.replace(config, batch_size=16, resume=True))
    except ValueError as err:
        messages["other batch size"] = str(err)
    for case, change in {  # another data order, other samples, or nothing left: all were accepted
        "other seed": {"seed": BASE.seed + 1, "stop_after": 2},
        "other length": {"seq_len": 16, "stop_after": 2},
        "nothing left": {},
    }.items():
        try:
            train(dataclasses.replace(config, resume=True, **change))  # type: ignore[arg-type]
        except ValueError as err:
            messages[case] = str(err)
    (base / "good" / "step-00000009.partial").mkdir()  # a save cut off earlier
    kept = checkpoint.save(base / "good", pipe, None, checkpoint.Progress(0, 0, 0), keep=1)
    messages["cut-off save left"] = str((base / "good" / "step-00000009.partial").exists())
    messages["older save kept"] = str(kept.is_dir())  # the newest beside it must not rotate it away
    blocked = base / "blocked"
    blocked.write_text("a file where the checkpoint folder should be")
    try:
        checkpoint.save(blocked, pipe, None, checkpoint.Progress(1, 0, 0))
    except checkpoint.CheckpointError as err:
        messages["unwritable"] = str(err)
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
    used = "good already holds checkpoints (the latest step-00000001), from an earlier run: continue that run "
    assert used in messages["fresh run into a used folder"]
    assert messages["older save kept"] == "True"
    assert messages["cut-off save left"] == "False"
    assert messages["other seed"].endswith(
        f"in the data order of seed {BASE.seed}, but this run's seed is {BASE.seed + 1}; resume with the same seed "
        f"(--seed {BASE.seed})"
    )
    assert messages["other length"].endswith(
        "in samples of 32 tokens, but this run's are 16; resume with the same sequence length (--seq-len 32)"
    )
    assert messages["nothing left"].endswith(
        "is at step 1, at or past this run's last step (1): there is nothing left to train; give a later "
        "--stop-after or more --steps"
    )
    assert messages["other batch size"].endswith(
        "stopped at batch 1 of epoch 0 in batches of 8 samples, but this run's batch size is 16; resume with the "
        "same batch size (--batch-size 8)"
    )
    assert messages["other optimizer"].endswith(
        "holds AdamW state, but the optimizer is SGD; resume with AdamW (stagewise train --optimizer adamw), "
        "or start afresh in another checkpoint directory"
    )


def unwritable_checkpoints(blocked: str) -> tuple[str, int]:
    """Train with a checkpoint folder that cannot be made: the error, and the steps run before it."""
    torch.set_num_threads(1)
    steps: list[int] = []
    config = dataclasses.replace(BASE, stages=1, steps=3, checkpoint_dir=f"{blocked}/checkpoints")
    try:
        train(config, on_step=lambda step, loss, seconds: steps.append(step))
    except checkpoint.CheckpointError as err:
        return str(err), len(steps)
    return "trained", len(steps)


def test_an_unwritable_checkpoint_folder_fails_before_the_first_step(tmp_path: Path) -> None:
    # It failed at the first save, after the steps before it had run (a whole run with --checkpoint-every 0).
    blocked = tmp_path / "a-file"
    blocked.write_text("a file where the checkpoint folder's parent should be")
    message, steps = run_ranks(unwritable_checkpoints, 1, str(blocked), timeout=120)[0]
    assert message.startswith(f"rank 0 cannot write checkpoints to {blocked}/checkpoints: "), message
    assert steps == 0


def tiny_validation(text: str) -> tuple[str, int]:
    """Train on a text whose validation split is smaller than a batch: the error, and the steps run before it."""
    torch.set_num_threads(1)
    steps: list[int] = []
    config = dataclasses.replace(BASE, stages=1, data=text, steps=4, checkpoint_dir=None)
    try:
        train(config, on_step=lambda step, loss, seconds: steps.append(step))
    except ValueError as err:
        return str(err), len(steps)
    finally:
        dist.destroy_process_group()
    return "no error", len(steps)


def test_a_validation_split_smaller_than_a_batch_fails_before_training(tmp_path: Path) -> None:
    text = tmp_path / "small.txt"
    text.write_text("".join(chr(97 + i % 26) for i in range(2000)))
    message, steps = run_ranks(tiny_validation, 1, str(text), timeout=120)[0]
    assert "fewer than one batch of 8" in message
    assert steps == 0


def fusions(configs: list[TrainConfig]) -> list[WeightGradientFusion | None]:
    torch.set_num_threads(1)
    found = [build_pipeline(config).fusion for config in configs]
    dist.destroy_process_group()
    return found


def test_the_weight_gradient_options_reach_the_pipeline() -> None:
    one = dataclasses.replace(BASE, stages=1)
    configs = [
        one,
        dataclasses.replace(one, weight_gradient_pool=2),
        dataclasses.replace(one, weight_gradient_fusion=False),
    ]
    assert run_ranks(fusions, 1, configs)[0] == [WeightGradientFusion(), WeightGradientFusion(pool=2), None]


def test_resume_without_a_checkpoint_dir_is_refused() -> None:
    with pytest.raises(ValueError, match=r"resume needs checkpoint_dir"):
        dataclasses.replace(BASE, resume=True)
    with pytest.raises(
        ValueError, match=r"weight_gradient_pool must be a number of backwards >= 1, 'free' or None, got 0"
    ):
        dataclasses.replace(BASE, weight_gradient_pool=0)
    with pytest.raises(ValueError, match=r"unknown model preset 'gpt-huge'"):
        dataclasses.replace(BASE, model="gpt-huge")
    with pytest.raises(ValueError, match=r"microbatches must be a whole number >= 1, got 0"):
        dataclasses.replace(BASE, microbatches=0)
    with pytest.raises(LaunchError, match=r"global_batch_size=8 is smaller than dp=1 x n_microbatches=16"):
        launch_run(dataclasses.replace(BASE, microbatches=16))
