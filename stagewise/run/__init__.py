"""The training job run on every rank: its config, where it starts, its run folder, and the loop."""

from stagewise.run.config import Optimizer, TrainConfig
from stagewise.run.loop import Summary, build_pipeline, train

__all__ = ["Optimizer", "Summary", "TrainConfig", "build_pipeline", "train"]
