"""The run folder's claim: which job writes checkpoints into a folder, so a restart knows its own."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from stagewise.checkpoint import CheckpointError
from stagewise.comm.agreement import everyone_agrees

JOB_FILE = "job"
"""The file in a checkpoint directory that names the job writing checkpoints there (see :func:`claim`)."""


def _claimed(directory: str | Path, line: int) -> str | None:
    try:
        lines = (Path(directory) / JOB_FILE).read_text().splitlines()
    except (FileNotFoundError, NotADirectoryError):
        return None
    return (lines[line].strip() or None) if line < len(lines) else None


def owner(directory: str | Path) -> str | None:
    """The id of the job that last claimed ``directory`` for its checkpoints (see :func:`claim`); None if none did."""
    return _claimed(directory, 0)


def owner_token(directory: str | Path) -> str | None:
    """The token of the job that last claimed ``directory`` (see :func:`claim`); None if it recorded none."""
    return _claimed(directory, 1)


def claim(directory: str | Path, job: str, device: torch.device, token: str | None = None) -> None:
    """Before training, rank 0 makes ``directory`` and records there that job ``job`` writes its checkpoints, with
    the job's ``token`` where it has one (:func:`stagewise.comm.job_identity.job_token`: the file ``job`` holds the id,
    and the token on a second line); every rank calls it. An unwritable directory fails here rather than at the
    first save, and after a failure the restarted ranks of that job find the directory theirs (:func:`owner`,
    :func:`owner_token`), where another job's is not."""
    root = Path(directory)
    problem = ""
    if (dist.get_rank() if dist.is_initialized() else 0) == 0:
        try:
            root.mkdir(parents=True, exist_ok=True)
            staged = root / f".{JOB_FILE}.partial"
            staged.write_text(f"{job}\n" + (f"{token}\n" if token else ""))
            staged.replace(root / JOB_FILE)  # at once: a restarted rank may be reading it
        except OSError as err:
            problem = f": {err}"
    if not everyone_agrees(not problem, device):
        raise CheckpointError(
            f"rank 0 cannot write checkpoints to {root}{problem}; choose a writable checkpoint directory"
        )
