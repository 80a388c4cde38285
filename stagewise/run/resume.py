"""Where a training run starts: afresh, or from which checkpoint, as --resume and torchrun's restarts decide."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from stagewise import checkpoint
from stagewise.comm.launch import job_token, restarts, shared_run_id
from stagewise.pipeline import Pipeline
from stagewise.run.config import TrainConfig
from stagewise.run.folder import claim, owner, owner_token

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Start:
    """Where a run starts."""

    position: checkpoint.Progress
    """The step and data position it continues from (step 0: afresh)."""
    checkpoint: Path | None
    """The latest complete checkpoint in the run's folder, loaded or not; None if there is none."""


def starting_point(config: TrainConfig, pipe: Pipeline, optimizer: torch.optim.Optimizer) -> Start:
    """Load the checkpoint this run continues, if any, and claim its checkpoint folder
    (:func:`~stagewise.run.folder.claim`).

    ``config.resume`` continues the latest checkpoint. A restart by torchrun's
    agent (TORCHELASTIC_RESTART_COUNT > 0) continues it when the job that
    claimed ``checkpoint_dir`` is this one: the same job id, and where that id
    names other jobs too (:func:`shared_run_id`) the same token from the
    agent's store (:func:`job_token`). Otherwise a folder that holds
    checkpoints is refused, as the first attempt refused it.
    """
    position = checkpoint.Progress(0, 0, 0)
    found = checkpoint.latest(config.checkpoint_dir) if config.checkpoint_dir is not None else None
    job, restarted, shared = os.environ.get("TORCHELASTIC_RUN_ID", ""), restarts() > 0, shared_run_id()
    token: str | None = None
    own: bool | None = False  # a restart continues its own job's checkpoints, never another's (see owns)
    if restarted and config.checkpoint_dir is not None:
        token = job_token(new=False, timeout=config.timeout) if shared else None
        own = owns(config.checkpoint_dir, job, token)
    if config.resume or own:
        if found is None:
            log.warning("no complete checkpoint in %s; starting from step 0", config.checkpoint_dir)
        else:
            position = checkpoint.load(found, pipe, optimizer)
            check_resumable(config, found, position, restart=own is True)
    elif found is not None:
        raise ValueError(
            fresh_run_refused(str(config.checkpoint_dir), found) if own is False else cannot_tell(found, job)
        )
    if config.checkpoint_dir is not None:
        if shared and not restarted and pipe.mesh.rank == 0:  # the first attempt's rank 0 records the job's token
            token = job_token(new=True, timeout=config.timeout)
        claim(config.checkpoint_dir, job, pipe.device, token)
    return Start(position, found)


def check_resume(config: TrainConfig) -> None:
    """What resuming ``config`` would refuse, checked by a launcher before it starts any process: a checkpoint
    whose data the run would not continue, or a run with nothing left to train (see :func:`check_resumable`)."""
    if not config.resume or config.checkpoint_dir is None:
        return
    found = checkpoint.latest(config.checkpoint_dir)
    if found is not None:
        check_resumable(config, found, checkpoint.progress_of(found), restart=False)


def check_resumable(config: TrainConfig, found: Path, position: checkpoint.Progress, *, restart: bool) -> None:
    """Refuse a resume whose data would not continue the checkpoint's, or that has nothing left to train; but a
    ``restart`` of the job that wrote ``found`` may find it at the last step (a rank died after the last save):
    that job has finished training."""
    where = f"the checkpoint {found} stopped at batch {position.batch} of epoch {position.epoch}"
    for theirs, ours, what in (
        (position.batch_size, config.batch_size, "in batches of {} samples, but this run's batch size is {}; resume "
         "with the same batch size (--batch-size {})"),
        (position.seed, config.seed, "in the data order of seed {}, but this run's seed is {}; resume with the same "
         "seed (--seed {})"),
        (position.sample_length, config.tokens_per_sample, "in samples of {} tokens, but this run's are {}; resume "
         "with the same sequence length (--seq-len {})"),
    ):  # fmt: skip
        if theirs is not None and theirs != ours:
            raise ValueError(f"{where} {what.format(theirs, ours, theirs)}")
    end = config.steps if config.stop_after is None else config.stop_after
    if position.step >= end and restart:
        log.warning("the restart found this job's checkpoint %s at its last step (%d): it only evaluates", found, end)
    elif position.step >= end:
        raise ValueError(
            f"the checkpoint {found} is at step {position.step}, at or past this run's last step ({end}): there is "
            "nothing left to train; give a later --stop-after or more --steps"
        )


def fresh_run_refused(directory: str | Path, found: Path) -> str:
    """Why a run that does not resume may not write into ``directory``, whose latest checkpoint is ``found``."""
    return (
        f"{directory} already holds checkpoints (the latest {found.name}), from an earlier run: continue that run "
        "with resume (stagewise train --resume), or start this one in another checkpoint directory (--checkpoint-dir "
        "DIR, or --no-checkpoints), or delete those checkpoints"
    )


def owns(directory: str, job: str, token: str | None) -> bool | None:
    """Whether a restart of job ``job`` may continue the checkpoints in ``directory``: the job that claimed it
    last (:func:`~stagewise.run.folder.claim`) had this id and,
    where the id names other jobs too (:func:`shared_run_id`),
    this job's ``token`` (:func:`job_token`); the id alone cannot tell such a job from an earlier one that left
    its checkpoints there. None: such an id, and no token here or in the folder, so it cannot tell."""
    if not job or owner(directory) != job:
        return False
    if not shared_run_id():
        return True
    theirs = owner_token(directory)
    return None if token is None or theirs is None else theirs == token


def cannot_tell(found: Path, job: str) -> str:
    """Why a restart whose job id names other jobs too does not continue the checkpoint ``found``."""
    return (
        f"this restart cannot tell whether the checkpoints in {found.parent} (the latest {found.name}) are this "
        f"job's: its id {job!r} names other jobs too (torchrun without --rdzv-id calls every job 'none'), and "
        "the store of torchrun's agent that would tell them apart holds no token of this job (or the folder "
        "recorded none); to continue them relaunch with resume (stagewise train --resume), or give each job a "
        "unique id (torchrun --rdzv-id, e.g. the scheduler's job id; launch(run_id=...))"
    )
