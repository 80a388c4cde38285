"""The runtime: the Pipeline running a schedule on its stages, with its data, parallelism and gradient parts.

Exported here is what a user calls: the Pipeline, its options and their types, the loader of each rank's
batches, pretrained weights and meta-device materialisation, the errors to catch, and torch interop. Everything
else is importable from its own module.
"""

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
