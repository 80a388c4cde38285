"""The runtime: the Pipeline running a schedule on its stages, with its data, parallelism and gradient parts."""

from stagewise.pipeline.batch_norm import BatchNormStatistics
from stagewise.pipeline.clip import clip_grad_norm_
from stagewise.pipeline.config import (
    Compute,
    DataParallel,
    Diagnostics,
    FullySharded,
    PipelineOptions,
    TensorParallelPlan,
)
from stagewise.pipeline.fusion import FusedWeightGradients, WeightGradientFusion, WeightGradientStore
from stagewise.pipeline.interop import torch_pipe, torch_runtime, torch_stages
from stagewise.pipeline.loader import Batch, LoaderOptions, StageLoader
from stagewise.pipeline.materialise import materialise_model
from stagewise.pipeline.microbatch import LossFn, LossReduction
from stagewise.pipeline.nonfinite import NonFinite, NonFiniteLossError
from stagewise.pipeline.pipe import Pipeline
from stagewise.pipeline.pretrained import PretrainedError, PretrainedLoad, load_pretrained, weight_files
from stagewise.pipeline.stage import StageError
from stagewise.pipeline.torch_schedules import from_actions, from_torch, to_torch

__all__ = [
    "Batch",
    "BatchNormStatistics",
    "Compute",
    "DataParallel",
    "Diagnostics",
    "FullySharded",
    "FusedWeightGradients",
    "LoaderOptions",
    "LossFn",
    "LossReduction",
    "NonFinite",
    "NonFiniteLossError",
    "Pipeline",
    "PipelineOptions",
    "PretrainedError",
    "PretrainedLoad",
    "StageError",
    "StageLoader",
    "TensorParallelPlan",
    "WeightGradientFusion",
    "WeightGradientStore",
    "clip_grad_norm_",
    "from_actions",
    "from_torch",
    "load_pretrained",
    "materialise_model",
    "to_torch",
    "torch_pipe",
    "torch_runtime",
    "torch_stages",
    "weight_files",
]
