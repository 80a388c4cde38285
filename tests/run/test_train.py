"""The training job: resume is exact, a run that would not continue the saved one is refused, bad settings too."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from support.multiproc import run_ranks
from support.training import BASE, Runs, exported, launch_run

from stagewise import checkpoint
from stagewise.comm import LaunchError
from stagewise.pipeline import WeightGradientFusion
from stagewise.run import TrainConfig, build_pipeline, train
from stagewise.run.job_pipeline import pipeline_options


def test_resume_continues_bitwise_exactly(runs: Runs) -> None:
    root = runs.root
    config = dataclasses.replace(BASE, checkpoint_dir=str(root / "half"), resume=True)
    rest = launch_run(config)
    assert runs.half + rest == runs.whole  # the same losses, bit for bit
    a = exported(root / "whole", 8, root / "a.pt")
    b = exported(root / "half", 8, root / "b.pt")
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    assert runs.whole[-1] < runs.whole[0]


@pytest.mark.parametrize("dp", [1, 2])
def test_stopped_and_resumed_twice_mid_epoch_the_losses_are_an_uninterrupted_runs(dp: int, tmp_path: Path) -> None:
    # The data position (epoch, batch, the order's seed) and every rank's generator are in the checkpoint: each
    # replica takes its own share of the very next global batches, bit for bit, whatever the stops.
    config = dataclasses.replace(BASE, dp=dp, steps=7, microbatches=2)
    whole = launch_run(dataclasses.replace(config, checkpoint_dir=str(tmp_path / "whole")))
    parts = [
        launch_run(
            dataclasses.replace(config, checkpoint_dir=str(tmp_path / "parts"), stop_after=stop, resume=stop > 2)
        )
        for stop in (2, 5, 7)
    ]
    assert [len(p) for p in parts] == [2, 3, 2]
    assert parts[0] + parts[1] + parts[2] == whole


def resume_refusals(root: str) -> dict[str, str]:
    """Save a 1-step run, then start runs into its folder that would not continue it; each one's refusal."""
    torch.set_num_threads(1)
    config = dataclasses.replace(BASE, pp=1, stop_after=1, checkpoint_dir=str(Path(root) / "good"))
    train(config)
    attempts = {
        "fresh run into a used folder": config,  # it would mix the two runs' checkpoints
        "other batch size": dataclasses.replace(config, batch_size=16, resume=True),  # batches count the position
        # another data order, other samples, or nothing left: all were accepted
        "other seed": dataclasses.replace(config, resume=True, seed=BASE.seed + 1, stop_after=2),
        "other length": dataclasses.replace(config, resume=True, seq_len=16, stop_after=2),
        "nothing left": dataclasses.replace(config, resume=True),
    }
    messages: dict[str, str] = {}
    for case, attempt in attempts.items():
        try:
            train(attempt)
        except ValueError as err:
            messages[case] = str(err)
    dist.destroy_process_group()
    return messages


def test_a_run_that_would_not_continue_the_saved_one_is_refused(tmp_path: Path) -> None:
    messages = run_ranks(resume_refusals, 1, str(tmp_path), timeout=120)[0]
    used = "good already holds checkpoints (the latest step-00000001), from an earlier run: continue that run "
    assert used in messages["fresh run into a used folder"]
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


def unwritable_checkpoints(blocked: str) -> tuple[str, int]:
    """Train with a checkpoint folder that cannot be made: the error, and the steps run before it."""
    torch.set_num_threads(1)
    steps: list[int] = []
    config = dataclasses.replace(BASE, pp=1, steps=3, checkpoint_dir=f"{blocked}/checkpoints")
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
    config = dataclasses.replace(BASE, pp=1, data=text, steps=4, checkpoint_dir=None)
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
    assert message.startswith("the validation split (the data held out): ") and "fewer than one batch of 8" in message
    assert steps == 0


def fusions(configs: list[TrainConfig]) -> list[WeightGradientFusion | None]:
    torch.set_num_threads(1)
    found = [build_pipeline(config)._runtime.fusion for config in configs]
    dist.destroy_process_group()
    return found


def test_the_weight_gradient_options_reach_the_pipeline() -> None:
    one = dataclasses.replace(BASE, pp=1)
    configs = [
        one,
        dataclasses.replace(one, weight_gradient_pool=2),
        dataclasses.replace(one, weight_gradient_fusion=False),
    ]
    assert run_ranks(fusions, 1, configs)[0] == [WeightGradientFusion(), WeightGradientFusion(pool=2), None]


def test_compile_reaches_the_pipeline() -> None:
    assert pipeline_options(dataclasses.replace(BASE, compile=True)).compute.compile is True
    assert pipeline_options(BASE).compute.compile is False


def test_resume_without_a_checkpoint_dir_is_refused() -> None:
    with pytest.raises(ValueError, match=r"resume needs checkpoint_dir"):
        dataclasses.replace(BASE, resume=True)
    with pytest.raises(
        ValueError, match=r"weight_gradient_pool must be a number of backwards >= 1, 'free' or None, got 0"
    ):
        dataclasses.replace(BASE, weight_gradient_pool=0)
    with pytest.raises(ValueError, match=r"unknown model 'gpt-huge': give a preset \("):
        dataclasses.replace(BASE, model="gpt-huge")
    with pytest.raises(ValueError, match=r"microbatches must be a whole number >= 1, got 0"):
        dataclasses.replace(BASE, microbatches=0)
    with pytest.raises(LaunchError, match=r"global_batch_size=8 is smaller than dp=1 x n_microbatches=16"):
        launch_run(dataclasses.replace(BASE, microbatches=16))


def test_a_sharded_layout_trains_as_the_pipeline_does(runs: Runs, tmp_path: Path) -> None:
    # The tied tiny GPT on one stage sharded by FSDP over 2 ranks and split over 2 tensor-parallel ranks: the same
    # losses as the 2-stage run, step by step (clipping, AdamW and the learning-rate schedule included).
    sharded = dataclasses.replace(BASE, pp=1, fsdp=2, tp=2, stop_after=3, checkpoint_dir=str(tmp_path))
    torch.testing.assert_close(launch_run(sharded), runs.whole[:3], atol=1e-5, rtol=1e-5)


def test_tensor_parallelism_of_a_model_without_a_plan_is_refused() -> None:
    from stagewise.run.job_pipeline import preflight

    with pytest.raises(ValueError, match=r"tp=2: tensor parallelism splits GPT presets' .* mlp-tiny is neither"):
        preflight(dataclasses.replace(BASE, model="mlp-tiny", pp=1, tp=2))
    with pytest.raises(ValueError, match=r"tp=8 does not divide the 4 attention heads .* choose tp among \[1, 2, 4\]"):
        preflight(dataclasses.replace(BASE, pp=1, tp=8))
    with pytest.raises(ValueError, match=r"tp=3 does not divide the vocabulary of 256 tokens"):
        preflight(dataclasses.replace(BASE, pp=1, tp=3))
