"""A rank killed in forward, backward, the optimizer step or a checkpoint save: the job ends fast and says who died.

With restarts, the job resumes from the last complete checkpoint and ends with
the parameters of a run that was never interrupted.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from support.faults import arm
from support.multiproc import run_ranks

from stagewise import checkpoint
from stagewise.checkpoint import folders
from stagewise.comm import LaunchError, Layout
from stagewise.comm.job_identity import SHARED_RUN_ID
from stagewise.comm.launch_options import child_environment
from stagewise.pipeline import Pipeline
from stagewise.run import Summary, TrainConfig, folder, train
from stagewise.run.rank import run_rank
from stagewise.run.resume import cannot_tell, owns

BASE = TrainConfig(
    model="gpt-tiny", pp=2, microbatches=2, batch_size=8, seq_len=32, steps=6, warmup=1, eval_every=0,
    checkpoint_every=2, timeout=60,
)  # fmt: skip


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def killed(phase: str, root: str) -> None:
    """Train on 2 ranks; rank 1 kills itself with SIGKILL in ``phase`` of step 4."""
    torch.set_num_threads(1)
    victim = int(os.environ["RANK"]) == 1

    def armed(pipe: Pipeline) -> None:
        if victim:  # in step 4: the save of step 2 is the latest complete checkpoint
            arm(pipe, phase, 4, BASE.microbatches, _die)

    train(dataclasses.replace(BASE, checkpoint_dir=root), on_start=armed)


@pytest.mark.parametrize("phase", ["forward", "backward", "optimizer", "save"])
def test_a_killed_rank_ends_the_job_quickly_and_is_named(phase: str, tmp_path: Path) -> None:
    began = time.monotonic()
    with pytest.raises(LaunchError) as info:
        run_ranks(killed, 2, phase, str(tmp_path), timeout=150, layout=Layout(2, 1))
    assert time.monotonic() - began < 60 + 15  # the survivor is stopped well within 60 s (plus start-up)
    dead = [f for f in info.value.failures if f.rank == 1]
    assert dead and dead[0].exitcode == -signal.SIGKILL, info.value.failures
    assert str(info.value).startswith("rank 1 (stage 1, replica 0) failed (exit code -9)"), str(info.value)
    if phase == "save":
        last = checkpoint.latest(tmp_path)
        assert last is not None and last.name == "step-00000002"  # the cut-off save does not count
        assert checkpoint.export(last, tmp_path / "model.pt").stat().st_size > 0


def interrupted(root: str) -> Summary:
    """Train afresh under the job id "none", which every job has when started so; rank 1 dies in the first attempt
    after step 5 (the last checkpoint is step 4's), and in the second right after the last save (step 6's). Rank 0
    writes each attempt's losses to ``root.losses``.

    The agent's restarts resume by themselves: a restarted run continues from the latest checkpoint of its job (the
    id names other jobs too, so the token in the agent's store tells), and the third attempt only evaluates.
    """
    torch.set_num_threads(1)
    attempt, rank = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")), int(os.environ["RANK"])

    def maybe_die(step: int, loss: float, seconds: float) -> None:
        if rank == 0:
            with open(f"{root}.losses", "a") as out:
                out.write(f"{attempt} {loss!r}\n")
        if attempt == 0 and rank == 1 and step == 5:
            _die()

    if attempt == 1 and rank == 1:
        real = checkpoint.Checkpointer.save

        def save_then_die(*args: Any, **kwargs: Any) -> Path:
            saved = real(*args, **kwargs)
            if saved.name == f"step-{BASE.steps:08d}":
                _die()
            return saved

        checkpoint.Checkpointer.save = save_then_die  # type: ignore[method-assign]
    return train(dataclasses.replace(BASE, checkpoint_dir=root), on_step=maybe_die)


def straight(root: str) -> Summary:
    torch.set_num_threads(1)
    return train(dataclasses.replace(BASE, checkpoint_dir=root))


def test_a_restarted_job_ends_with_the_parameters_of_an_uninterrupted_one(tmp_path: Path) -> None:
    whole = run_ranks(straight, 2, str(tmp_path / "whole"), timeout=150)[0]
    root = tmp_path / "restarted"
    last = run_ranks(interrupted, 2, str(root), timeout=240, max_restarts=2, run_id="none")[0]
    attempts: dict[int, list[float]] = {}
    for line in Path(f"{root}.losses").read_text().splitlines():
        attempt, loss = line.split()
        attempts.setdefault(int(attempt), []).append(float(loss))
    assert attempts[0] == whole.losses[:5]
    assert attempts[1] == whole.losses[4:]  # the restart continued from the checkpoint of step 4, bit for bit
    # A restart after the last save failed with "nothing left to train": it has finished, and only evaluates.
    assert 2 not in attempts and last.first_step == 6 and last.losses == []
    assert last.evals == whole.evals == [(6, whole.evals[0][1])]
    assert last.checkpoint == str(root / "step-00000006")
    a = torch.load(checkpoint.export(tmp_path / "whole" / "step-00000006", tmp_path / "a.pt"), weights_only=True)
    b = torch.load(checkpoint.export(root / "step-00000006", tmp_path / "b.pt"), weights_only=True)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def fresh(root: str) -> tuple[list[float], bool]:
    """Train two steps afresh into ``root`` as the CLI's ranks do, or fail on finding another run's checkpoints
    there; the losses, and whether the process group is still open afterwards."""
    torch.set_num_threads(1)
    losses = run_rank(dataclasses.replace(BASE, pp=1, checkpoint_dir=root, steps=2, checkpoint_every=0)).losses
    return losses, torch.distributed.is_initialized()


def test_a_restarted_job_never_continues_another_jobs_checkpoints(tmp_path: Path) -> None:
    # The first attempt refused the folder of an earlier run; the agent counted that as a failure and restarted,
    # and the restart, which continues from the latest checkpoint, trained on from the other run's. Both jobs have
    # the id "none" (as every job torchrun starts on several nodes without --rdzv-id): the restart took the
    # folder, which the earlier job had claimed under that id, for its own.
    losses, still_open = run_ranks(fresh, 1, str(tmp_path), timeout=150, run_id="none")[0]
    assert len(losses) == 2 and folder.owner(tmp_path) == "none" and folder.owner_token(tmp_path)
    assert not still_open  # the job's groups are released (NCCL warned at exit of one left open)
    with pytest.raises(LaunchError, match=r"already holds checkpoints \(the latest step-00000002\), from an earlier"):
        run_ranks(fresh, 1, str(tmp_path), timeout=150, max_restarts=1, run_id="none")
    assert [p.name for p in folders.complete(tmp_path)] == ["step-00000002"]


def test_a_restart_trusts_a_unique_job_id_and_a_shared_one_only_with_its_jobs_token(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A restart of a job whose id every job had ("none", or launch's id of several nodes) continued another job's
    # checkpoints; an empty id counted as the folder's owner.
    def verdict(job: str, claimed: str, token: str | None, theirs: str | None) -> bool | None:
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", job)
        folder.claim(tmp_path, claimed, torch.device("cpu"), theirs)
        return owns(str(tmp_path), job, token)

    monkeypatch.delenv(SHARED_RUN_ID, raising=False)
    assert verdict("a1b2", "a1b2", None, None) is True  # a unique id is trusted
    assert verdict("a1b2", "c3d4", None, None) is False
    assert verdict("", "", None, None) is False
    assert verdict("none", "none", "t1", "t1") is True
    assert verdict("none", "none", "t2", "t1") is False  # an earlier job under the same id
    assert verdict("none", "none", None, "t1") is None  # no agent store: it cannot tell
    assert verdict("none", "none", "t1", None) is None  # the folder recorded no token
    shared = child_environment({"nnodes": 2, "rdzv_endpoint": "node0:29500"})[SHARED_RUN_ID]
    assert shared == "stagewise-node0:29500" and SHARED_RUN_ID not in child_environment({"nnodes": 2, "run_id": "j7"})
    monkeypatch.setenv(SHARED_RUN_ID, shared)
    assert verdict(shared, shared, "t2", "t1") is False and verdict(shared, shared, "t1", "t1") is True
    assert verdict(shared, shared, None, "t1") is None
    found = tmp_path / "step-00000004"
    assert cannot_tell(found, "none").endswith(
        "relaunch with resume (stagewise train --resume), or give each job a unique id (torchrun --rdzv-id, e.g. "
        "the scheduler's job id; launch(run_id=...))"
    )
