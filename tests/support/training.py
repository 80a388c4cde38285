"""Short training runs that the job's and the checkpoints' tests share: one base config, its launch, exports."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from stagewise import checkpoint
from stagewise.run import TrainConfig, train
from support.multiproc import run_ranks

BASE = TrainConfig(
    model="gpt-tiny-tied",
    pp=2,
    microbatches=2,
    batch_size=8,
    seq_len=32,
    steps=8,
    warmup=2,
    eval_every=0,
    eval_batches=1,
    timeout=60,
)
"""Eight steps of the tied tiny GPT on two stages: seconds to run, and every checkpointed kind of state in it."""


@dataclasses.dataclass(frozen=True)
class Runs:
    """An uninterrupted 8-step run and a 4-step run to resume from, both checkpointed under ``root``."""

    root: Path
    whole: list[float]
    """The 8-step run's losses; its checkpoints are at steps 4 and 8 in ``root / "whole"``."""
    half: list[float]
    """The 4-step run's losses; its checkpoint is at step 4 in ``root / "half"``."""


def run(config: TrainConfig) -> list[float]:
    """One rank's part of a training run: its losses (every rank returns the last stage's)."""
    torch.set_num_threads(1)
    return train(config).losses


def launch_run(config: TrainConfig) -> list[float]:
    """Run ``config`` on its ranks, in processes of their own; the losses."""
    return run_ranks(run, config.world_size, config, timeout=180)[0]


def reference_runs(root: Path) -> Runs:
    """Train :data:`BASE` whole and to its middle, into ``root``."""
    whole = dataclasses.replace(BASE, checkpoint_dir=str(root / "whole"), checkpoint_every=4)
    half = dataclasses.replace(BASE, stop_after=4, checkpoint_dir=str(root / "half"))
    return Runs(root, launch_run(whole), launch_run(half))


def exported(directory: Path, step: int, into: Path) -> dict[str, torch.Tensor]:
    """The unsplit model's state dict of the checkpoint at ``step`` in ``directory``."""
    out = checkpoint.export(directory / f"step-{step:08d}", into)
    return torch.load(out, weights_only=True)
