"""The runtime: the Pipeline running a schedule on its stages, with its data, parallelism and gradient parts.

Exported here is what a user calls: the Pipeline, its options and their types, the loader of each rank's
batches, pretrained weights and meta-device materialisation, the errors to catch, and torch interop. Everything
else is importable from its own module.

The names load on first use (``import stagewise.pipeline.config`` imports no runtime).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from stagewise.pipeline.config import (
        BatchNormStatistics,
        Compute,
        DataParallel,
        Diagnostics,
        FullySharded,
        Initialiser,
        Loss,
        LossFn,
        LossReduction,
        NonFinite,
        PipelineOptions,
        SelectiveCheckpointing,
        TensorParallelPlan,
        WeightGradientFusion,
    )
    from stagewise.pipeline.interop.torch_pipe import torch_pipe, torch_runtime, torch_stages
    from stagewise.pipeline.interop.torch_schedules import from_torch, to_torch
    from stagewise.pipeline.loader import Batch, LoaderOptions, StageLoader
    from stagewise.pipeline.loss.nonfinite import NonFiniteLossError
    from stagewise.pipeline.pipe import Pipeline
    from stagewise.pipeline.pretrained import PretrainedError, load_pretrained
    from stagewise.pipeline.stage.materialise import materialise_model
    from stagewise.pipeline.stage.module import StageError

_HOMES = {
    "BatchNormStatistics": "stagewise.pipeline.config",
    "Compute": "stagewise.pipeline.config",
    "DataParallel": "stagewise.pipeline.config",
    "Diagnostics": "stagewise.pipeline.config",
    "FullySharded": "stagewise.pipeline.config",
    "Initialiser": "stagewise.pipeline.config",
    "Loss": "stagewise.pipeline.config",
    "LossFn": "stagewise.pipeline.config",
    "LossReduction": "stagewise.pipeline.config",
    "NonFinite": "stagewise.pipeline.config",
    "PipelineOptions": "stagewise.pipeline.config",
    "SelectiveCheckpointing": "stagewise.pipeline.config",
    "TensorParallelPlan": "stagewise.pipeline.config",
    "WeightGradientFusion": "stagewise.pipeline.config",
    "torch_pipe": "stagewise.pipeline.interop.torch_pipe",
    "torch_runtime": "stagewise.pipeline.interop.torch_pipe",
    "torch_stages": "stagewise.pipeline.interop.torch_pipe",
    "from_torch": "stagewise.pipeline.interop.torch_schedules",
    "to_torch": "stagewise.pipeline.interop.torch_schedules",
    "Batch": "stagewise.pipeline.loader",
    "LoaderOptions": "stagewise.pipeline.loader",
    "StageLoader": "stagewise.pipeline.loader",
    "NonFiniteLossError": "stagewise.pipeline.loss.nonfinite",
    "Pipeline": "stagewise.pipeline.pipe",
    "PretrainedError": "stagewise.pipeline.pretrained",
    "load_pretrained": "stagewise.pipeline.pretrained",
    "materialise_model": "stagewise.pipeline.stage.materialise",
    "StageError": "stagewise.pipeline.stage.module",
}
"""Where each name lives."""

__all__ = [
    "Batch",
    "BatchNormStatistics",
    "Compute",
    "DataParallel",
    "Diagnostics",
    "FullySharded",
    "Initialiser",
    "LoaderOptions",
    "Loss",
    "LossFn",
    "LossReduction",
    "NonFinite",
    "NonFiniteLossError",
    "Pipeline",
    "PipelineOptions",
    "PretrainedError",
    "SelectiveCheckpointing",
    "StageError",
    "StageLoader",
    "TensorParallelPlan",
    "WeightGradientFusion",
    "from_torch",
    "load_pretrained",
    "materialise_model",
    "to_torch",
    "torch_pipe",
    "torch_runtime",
    "torch_stages",
]


def __getattr__(name: str) -> Any:
    """Load one of the names above from its module when it is first asked for."""
    if name in _HOMES:
        return getattr(importlib.import_module(_HOMES[name]), name)
    raise AttributeError(f"module 'stagewise.pipeline' has no attribute {name!r}")
