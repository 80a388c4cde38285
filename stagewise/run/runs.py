"""Run folders of the command line: a fresh folder per run under one root, the ``latest`` link to the newest, the
paths a run writes there (``RUN/...``), and its job file."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import os
import time
from pathlib import Path
from typing import Any

from stagewise.run.config import TrainConfig

ROOT = Path("stagewise-run")
"""Where ``stagewise train`` keeps its runs by default, one folder each."""

LATEST = "latest"
"""The link in a root to its newest run's folder, which ``--resume`` continues."""


def new_run(root: Path) -> Path:
    """Make a fresh folder for a run under ``root``, named after the local time it starts
    (``20261205-071502``, then ``-2``, ``-3`` within the same second), and point ``root/latest`` at it."""
    root.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for n in itertools.count(1):
        folder = root / (stamp if n == 1 else f"{stamp}-{n}")
        try:
            folder.mkdir()
        except FileExistsError:
            continue
        break
    link = root / f".{LATEST}-{os.getpid()}"
    with contextlib.suppress(FileNotFoundError):
        link.unlink()
    link.symlink_to(folder.name, target_is_directory=True)
    os.replace(link, root / LATEST)  # atomic: a reader finds the old run or the new one, never none
    return folder


def latest_run(root: Path) -> Path | None:
    """The folder ``root/latest`` points at, or None when there is no run under ``root``."""
    link = root / LATEST
    return link.resolve() if link.is_dir() else None


RUN = "RUN"
"""A path's first part that stands for the run's folder, whichever it turns out to be (``RUN/checkpoints``)."""

CONFIG = "config.toml"
"""The run folder's job file: every setting the run resolved to (see :mod:`stagewise.run.job`)."""

IN_RUN_FOLDER: dict[str, str] = {"checkpoint_dir": f"{RUN}/checkpoints", "metrics": f"{RUN}/metrics.jsonl"}
"""What ``stagewise train`` writes into the run's folder unless told otherwise: its checkpoints and metrics."""

_PATHS = ("checkpoint_dir", "metrics", "tensorboard", "wandb", "trace")
"""The settings that are paths a run writes, which may lie in its folder (``RUN/...``)."""


def _in_run(path: str | None) -> bool:
    """Whether ``path`` lies in the run's folder (starts with :data:`RUN`)."""
    return isinstance(path, str) and Path(path).parts[:1] == (RUN,)


def in_folder(config: TrainConfig, folder: Path) -> TrainConfig:
    """``config`` with each path under :data:`RUN` placed in the run's ``folder``."""
    moved: dict[str, Any] = {}
    for name in _PATHS:
        value = getattr(config, name)
        if _in_run(value):
            moved[name] = str(folder.joinpath(*Path(value).parts[1:]))
    return dataclasses.replace(config, **moved)


def writes_in_folder(config: TrainConfig) -> bool:
    """Whether ``config`` keeps its checkpoints in the run's folder (so ``--resume`` finds them there)."""
    return _in_run(config.checkpoint_dir)


def writable(what: str, folder: Path) -> None:
    """Make ``folder`` now, so that an output that cannot be written fails before training, not after it."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ValueError(f"{what}: cannot make the folder {folder} ({err.strerror}); choose a writable one") from err


def under_torchrun() -> bool:
    """Whether this process is a rank torchrun started (rather than the one that starts the ranks): its run folder
    is the root, which every rank names alike."""
    return "TORCHELASTIC_RUN_ID" in os.environ or "RANK" in os.environ


def chosen_folder(out: Path | None, config: TrainConfig, *, torchrun: bool, root: Path = ROOT) -> Path | None:
    """The run's folder when the command names one: ``out``, the latest run for a resume whose checkpoints are in
    its folder, or under torchrun the root (every rank must name the same folder); None: a new one, made once
    everything is checked."""
    if out is not None:
        return out
    if torchrun:
        return root
    if config.resume and writes_in_folder(config):  # the run's checkpoints are in its folder: find it
        found = latest_run(root)
        if found is None:
            raise ValueError(
                f"--resume continues the latest run in {root}/, but there is none there; start one without "
                "--resume, or name the run's folder with --out"
            )
        return found
    return None


def made_folder(chosen: Path | None, *, root: Path = ROOT) -> Path:
    """The run's folder, made now: ``chosen``, or a new one under ``root`` when none was chosen."""
    if chosen is not None:
        writable("--out", chosen)
        out = chosen
    else:
        writable("--out", root)
        out = new_run(root)
    return out


def keep_config(folder: Path, config: TrainConfig) -> Path:
    """Write ``config``'s job file into the run's ``folder`` as :data:`CONFIG`, atomically."""
    from stagewise.run.job import config_text

    target = folder / CONFIG
    staged = folder / f".{CONFIG}.partial-{os.getpid()}"
    staged.write_text(config_text(config))
    os.replace(staged, target)
    return target
