"""stagewise: split PyTorch models into balanced pipeline stages and train them across devices.

The subpackages load on first use, so ``import stagewise.schedule`` (pure data) imports no torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from stagewise import comm, models, partition, pipeline, schedule
    from stagewise.errors import StagewiseError
    from stagewise.partition import LayerCost, Partition, auto, balance, layers_of, profile
    from stagewise.pipeline import Pipeline

__version__ = "0.1.0"

_SUBPACKAGES = frozenset({"comm", "models", "partition", "pipeline", "schedule"})
_NAMES = {
    "LayerCost": "stagewise.partition",
    "Partition": "stagewise.partition",
    "auto": "stagewise.partition",
    "balance": "stagewise.partition",
    "layers_of": "stagewise.partition",
    "profile": "stagewise.partition",
    "Pipeline": "stagewise.pipeline",
    "StagewiseError": "stagewise.errors",
}

__all__ = [
    "LayerCost",
    "Partition",
    "Pipeline",
    "StagewiseError",
    "__version__",
    "auto",
    "balance",
    "comm",
    "layers_of",
    "models",
    "partition",
    "pipeline",
    "profile",
    "schedule",
]


def __getattr__(name: str) -> Any:
    """Load a subpackage, or one of the names above from its subpackage, when it is first asked for."""
    if name in _SUBPACKAGES:
        return importlib.import_module(f"stagewise.{name}")
    if name in _NAMES:
        return getattr(importlib.import_module(_NAMES[name]), name)
    raise AttributeError(f"module 'stagewise' has no attribute {name!r}")
