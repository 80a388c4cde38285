"""One rank's part of ``stagewise train``: logging set up anew in a launched process, stop signals, and a reporter
that rank 0 shows the run's progress with."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Protocol

import torch

from stagewise.pipeline import Pipeline
from stagewise.run.config import TrainConfig
from stagewise.run.logs import LOG_FORMAT
from stagewise.run.loop import Summary, train
from stagewise.run.stopping import StopSignals


class Reporter(Protocol):
    """What shows a run's progress on rank 0 (the command line's progress bar or lines)."""

    def started(self, pipe: Pipeline) -> None: ...

    def stepped(self, step: int, loss: float, seconds: float) -> None: ...

    def close(self) -> None: ...


def run_rank(
    config: TrainConfig, verbose: bool = False, reporter: Callable[[TrainConfig], Reporter] | None = None
) -> Summary:
    """Train ``config`` as this process's rank; rank 0 shows its progress through ``reporter(config)`` (None: it
    shows none). ``verbose`` logs debug messages (a launched process configures its logging anew). SIGINT and
    SIGTERM end the run after the step in progress, with a checkpoint (:class:`StopSignals`)."""
    logging.basicConfig(level=logging.DEBUG if verbose else logging.WARNING, format=LOG_FORMAT)
    shown = reporter(config) if reporter is not None and int(os.environ.get("RANK", "0")) == 0 else None
    try:
        with StopSignals() as stop:
            summary = train(
                config,
                on_start=shown.started if shown else None,
                on_step=shown.stepped if shown else None,
                stop=stop,
            )
    finally:
        if shown is not None:
            shown.close()
    # The job is over on every rank: release its groups (NCCL warns of a leak at exit for one left open).
    torch.distributed.destroy_process_group()
    return summary
