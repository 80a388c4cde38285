"""Where a training run starts: afresh, or from which checkpoint, as --resume and torchrun's restarts decide."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from stagewise import checkpoint
from stagewise.checkpoint.folders import WriterLock, check_unlocked, step_folder, step_of
from stagewise.comm.agreement import everyone_agrees
from stagewise.comm.job_identity import job_token, restarts, shared_run_id
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
    """The checkpoint in the run's folder that rank 0 chose (the newest that verifies), loaded or not; None if
    there is none."""
    lock: WriterLock | None = None
    """Rank 0's lock on the checkpoint directory, held until the run ends (see :func:`release`)."""


@dataclass(frozen=True)
class _Found:
    """What rank 0 found in the checkpoint directory, the same on every rank."""

    latest: Path | None
    """The newest complete checkpoint, verified or not: a fresh run refuses a folder that has one."""
    chosen: Path | None
    """The newest that verifies: the one to resume from."""
    refused: str = ""
    """Why newer ones were refused (rank 0's words; empty elsewhere)."""


def _found(config: TrainConfig, device: torch.device) -> _Found:
    """Rank 0 lists and verifies the checkpoints; every rank gets its choice, so all load the same one (a folder
    that is not shared, or a stale listing on one node, cannot split them)."""
    directory = config.checkpoint_dir
    if directory is None:
        return _Found(None, None)
    rank = dist.get_rank() if dist.is_initialized() else 0
    steps, refused = [-1, -1], ""
    if rank == 0:
        newest = checkpoint.latest(directory)
        choice = checkpoint.choose(directory, checksums=config.verify_checksums)
        steps = [step_of(p) if p is not None else -1 for p in (newest, choice.path)]
        refused = choice.describe() if choice.refused else ""
    if dist.is_initialized():
        shared = torch.tensor(steps, dtype=torch.int64, device=device)
        dist.broadcast(shared, src=0)
        steps = [int(v) for v in shared.tolist()]
    latest, chosen = (step_folder(directory, s) if s >= 0 else None for s in steps)
    return _Found(latest, chosen, refused)


def _locked(config: TrainConfig, device: torch.device) -> WriterLock | None:
    """Rank 0 takes the checkpoint directory's lock for the run (every rank learns whether it could)."""
    if config.checkpoint_dir is None:
        return None
    lock, problem = None, ""
    if (dist.get_rank() if dist.is_initialized() else 0) == 0:
        try:
            Path(config.checkpoint_dir).mkdir(parents=True, exist_ok=True)
            lock = WriterLock(config.checkpoint_dir).acquire()
        except OSError as err:
            problem = f"rank 0 cannot write checkpoints to {config.checkpoint_dir}: {err}; choose a writable one"
        except checkpoint.CheckpointError as err:
            problem = str(err)
    if not everyone_agrees(not problem, device):
        raise checkpoint.CheckpointError(
            problem or f"rank 0 could not lock {config.checkpoint_dir} (its error says why)"
        )
    return lock


def release(start: Start) -> None:
    """Release what :func:`starting_point` holds for the run (rank 0's lock)."""
    if start.lock is not None:
        start.lock.release()


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
    lock = _locked(config, pipe.mesh.device)
    try:
        return _started(config, pipe, optimizer, lock)
    except BaseException:
        if lock is not None:
            lock.release()
        raise


def _started(config: TrainConfig, pipe: Pipeline, optimizer: torch.optim.Optimizer, lock: WriterLock | None) -> Start:
    position = checkpoint.Progress(0, 0, 0)
    found = _found(config, pipe.mesh.device)
    job, restarted, shared = os.environ.get("TORCHELASTIC_RUN_ID", ""), restarts() > 0, shared_run_id()
    token: str | None = None
    own: bool | None = False  # a restart continues its own job's checkpoints, never another's (see owns)
    if restarted and config.checkpoint_dir is not None:
        token = job_token(new=False, timeout=config.timeout) if shared else None
        own = owns(config.checkpoint_dir, job, token)
    if config.resume or own:
        if found.chosen is None and not restarted:
            raise ValueError(nothing_to_resume(str(config.checkpoint_dir), found.refused))
        if found.chosen is None:
            log.warning("no complete checkpoint in %s; the restart starts from step 0", config.checkpoint_dir)
        else:
            position = checkpoint.load(found.chosen, pipe, optimizer)
            check_resumable(config, found.chosen, position, restart=own is True)
    elif found.latest is not None:
        raise ValueError(
            fresh_run_refused(str(config.checkpoint_dir), found.latest)
            if own is False
            else cannot_tell(found.latest, job)
        )
    if config.checkpoint_dir is not None:
        if shared and not restarted and pipe.mesh.rank == 0:  # the first attempt's rank 0 records the job's token
            token = job_token(new=True, timeout=config.timeout)
        claim(config.checkpoint_dir, job, pipe.mesh.device, token)
    return Start(position, found.chosen, lock)


def nothing_to_resume(directory: str, refused: str = "") -> str:
    """Why a resume of ``directory`` cannot start: it holds no checkpoint that verifies."""
    why = f" ({refused})" if refused else ""
    return (
        f"resume continues the latest checkpoint in {directory}, but it holds none that is complete and intact{why}; "
        "start without --resume, or name the run that has them (--out DIR or --checkpoint-dir DIR)"
    )


def check_resume(config: TrainConfig) -> None:
    """What the run would refuse, checked by a launcher before it starts any process: a checkpoint directory
    another run writes, a resume with no checkpoint whose files match its manifest, a checkpoint whose data the
    run would not continue, or a run with nothing left to train (see :func:`check_resumable`)."""
    if config.checkpoint_dir is not None:
        check_unlocked(config.checkpoint_dir)
    if not config.resume or config.checkpoint_dir is None:
        return
    choice = checkpoint.choose(config.checkpoint_dir, checksums=False)  # sizes here; rank 0 checks the rest
    if choice.path is None:
        raise ValueError(nothing_to_resume(config.checkpoint_dir, choice.describe() if choice.refused else ""))
    check_resumable(config, choice.path, checkpoint.progress_of(choice.path), restart=False)


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
