"""Pipeline schedules as validated data, their simulator and pictures, the Pipeline that runs them, and its data."""

from stagewise.pipeline import schedules
from stagewise.pipeline.actions import Action, Kind, Schedule
from stagewise.pipeline.clip import clip_grad_norm_
from stagewise.pipeline.data import Batch, StageLoader
from stagewise.pipeline.engine import Event, ScheduleError
from stagewise.pipeline.executor import LossFn
from stagewise.pipeline.fusion import FusedWeightGradients, WeightGradientFusion, WeightGradientStore
from stagewise.pipeline.hybrid import DataParallel
from stagewise.pipeline.interop import torch_pipe
from stagewise.pipeline.microbatch import LossReduction
from stagewise.pipeline.nonfinite import NonFinite, NonFiniteLossError
from stagewise.pipeline.pipe import Pipeline
from stagewise.pipeline.pooling import free_pool, holdings, rank_pool
from stagewise.pipeline.render import render, to_chrome_trace
from stagewise.pipeline.schedules import ScheduleName, build
from stagewise.pipeline.simulate import SimulationResult, StageCosts, simulate
from stagewise.pipeline.stage import StageError, materialise_model
from stagewise.pipeline.trace import Span
from stagewise.pipeline.validate import ScheduleReport, peak_in_flight, validate

__all__ = [
    "Action",
    "Batch",
    "DataParallel",
    "Event",
    "FusedWeightGradients",
    "Kind",
    "LossFn",
    "LossReduction",
    "NonFinite",
    "NonFiniteLossError",
    "Pipeline",
    "Schedule",
    "ScheduleError",
    "ScheduleName",
    "ScheduleReport",
    "SimulationResult",
    "Span",
    "StageCosts",
    "StageError",
    "StageLoader",
    "WeightGradientFusion",
    "WeightGradientStore",
    "build",
    "clip_grad_norm_",
    "free_pool",
    "holdings",
    "materialise_model",
    "peak_in_flight",
    "rank_pool",
    "render",
    "schedules",
    "simulate",
    "to_chrome_trace",
    "torch_pipe",
    "validate",
]
