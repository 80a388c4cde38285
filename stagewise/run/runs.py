"""Run folders of the command line: a fresh folder per run under one root, and the ``latest`` link to the newest."""

from __future__ import annotations

import contextlib
import itertools
import os
import time
from pathlib import Path

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
