"""The process that starts a run: what it checks before any rank starts, and the local ranks it launches.

Without torchrun, ``stagewise train`` starts ``pp x dp x fsdp x tp`` local processes through torch's elastic
agent (:func:`stagewise.comm.launch`); under torchrun every process is a rank already. What the ranks would
refuse is checked here first, so that a bad value is one line and not a traceback per rank.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from stagewise import checkpoint
from stagewise.comm import LaunchError, launch
from stagewise.comm.cpu_pinning import usable_cores
from stagewise.errors import JobFailureError
from stagewise.run.config import TrainConfig
from stagewise.run.job_pipeline import preflight
from stagewise.run.loop import Summary
from stagewise.run.rank import Reporter, run_rank
from stagewise.run.resume import check_resume, fresh_run_refused
from stagewise.run.runs import writable

TORCH_LAUNCHER_LOGGERS = ("torch.distributed.elastic", "torch.multiprocessing")
"""The loggers of torch's agent, which the launching process quiets unless asked to be verbose."""
ERROR_LOG = "error.log"
"""The run folder's report of a failed launch: every rank's traceback."""


@dataclass(frozen=True)
class LocalLaunch:
    """How the launching process starts the ranks on this machine."""

    max_restarts: int = 0
    """Restart all local processes this often after a failure, resuming from the latest checkpoint."""
    pin_cores: bool = False
    """Give each local process its own share of the CPUs."""


class JobFailedError(JobFailureError):
    """A job whose processes failed, told in one line (the whole report is in the log it names)."""


def checked_before_start(config: TrainConfig, local: LocalLaunch, *, torchrun: bool) -> None:
    """Refuse here what the ranks would refuse: the launch settings, and without torchrun the run's own
    (:func:`~stagewise.run.job_pipeline.preflight`), its resume, and a fresh run into a folder of checkpoints."""
    if config.trace is not None:
        writable("--trace", Path(config.trace).parent)
    if local.max_restarts < 0:
        raise ValueError(f"--max-restarts must be >= 0, got {local.max_restarts}")
    if torchrun and local.pin_cores:
        raise ValueError("--pin-cores applies when stagewise starts the processes; torchrun started these")
    if torchrun and local.max_restarts:
        raise ValueError(
            "--max-restarts applies when stagewise starts the processes; torchrun started these: "
            "give torchrun --max-restarts (a restarted run resumes from --checkpoint-dir by itself)"
        )
    if torchrun:
        return
    if local.max_restarts and config.checkpoint_dir is None:
        raise ValueError("--max-restarts resumes from checkpoints; give --checkpoint-dir")
    preflight(config)
    check_resume(config)
    found = checkpoint.latest(config.checkpoint_dir) if config.checkpoint_dir and not config.resume else None
    if found is not None:  # refused here, before any process starts (and is restarted to meet it again)
        raise ValueError(fresh_run_refused(str(config.checkpoint_dir), found))


def crowding(processes: int, cores: int | None = None) -> str | None:
    """Why ``processes`` local processes on ``cores`` CPU cores (this process's, by default) will be slow, if so."""
    if cores is None:
        cores = usable_cores()
    if processes <= cores:
        return None
    return (
        f"{processes} processes share {cores} CPU cores, so each step waits for processes that are not running; "
        f"at most {cores} processes (--pp x --dp x --fsdp x --tp) run at full speed"
    )


def launched(
    config: TrainConfig, local: LocalLaunch, out: Path, reporter: Callable[[TrainConfig], Reporter] | None = None
) -> dict[int, Summary]:
    """Run ``config`` on local processes (GPUs where there is one per process); a failure is one line naming the
    rank, its stage and the cause (:class:`JobFailedError`), with the whole report in ``out/error.log``."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    verbose = logging.getLogger("stagewise").isEnabledFor(logging.DEBUG)
    if not verbose:  # torch's agent logs a failed rank's traceback too: the user gets one line, the log the rest
        for name, logger in list(logging.root.manager.loggerDict.items()):
            if isinstance(logger, logging.Logger) and name.startswith(TORCH_LAUNCHER_LOGGERS):
                logger.setLevel(logging.CRITICAL)
    try:
        return launch(
            run_rank,
            config.world_size,
            config,
            verbose,
            reporter,
            device="auto" if gpus >= config.world_size else "cpu",
            tee=False,
            max_restarts=local.max_restarts,
            layout=config.layout,
            pin_cores=local.pin_cores,
            pass_stop_signals=True,
        )
    except LaunchError as err:
        log = out / ERROR_LOG
        log.write_text(f"{err}\n")
        raise JobFailedError(f"{err.headline} (the full report: {log})") from None
