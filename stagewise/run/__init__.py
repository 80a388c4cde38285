"""The training job run on every rank: its config, where it starts, its run folder, and the loop.

The names below load on first use, so that a light module of the package (``stagewise.run.logs``) imports no
torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from stagewise.run.config import Optimizer, TrainConfig
    from stagewise.run.job_pipeline import build_pipeline
    from stagewise.run.loop import Summary, train

_NAMES = {
    "Optimizer": "stagewise.run.config",
    "TrainConfig": "stagewise.run.config",
    "Summary": "stagewise.run.loop",
    "build_pipeline": "stagewise.run.job_pipeline",
    "train": "stagewise.run.loop",
}

__all__ = ["Optimizer", "Summary", "TrainConfig", "build_pipeline", "train"]


def __getattr__(name: str) -> Any:
    """Load one of the names above from its module when it is first asked for."""
    if name in _NAMES:
        return getattr(importlib.import_module(_NAMES[name]), name)
    raise AttributeError(f"module 'stagewise.run' has no attribute {name!r}")
