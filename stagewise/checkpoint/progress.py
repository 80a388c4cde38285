"""Progress: where training stands (steps done, the data position), and its record in a checkpoint, both ways."""

from __future__ import annotations

from dataclasses import dataclass

import torch

KEY = "progress"
"""The checkpoint entry that holds the record: int64 numbers, as :func:`encode` writes them."""


@dataclass(frozen=True)
class Progress:
    """Where training stands: the steps done, and the data position of the next step."""

    step: int
    """Optimizer steps completed."""
    epoch: int
    """The epoch of the next batch."""
    batch: int
    """The index within that epoch of the next batch."""
    batch_size: int | None = None
    """The global batch size that ``batch`` counts in; None: not recorded (checkpoints from before it was)."""
    seed: int | None = None
    """The seed of the data order that ``epoch`` and ``batch`` point into; None: not recorded."""
    sample_length: int | None = None
    """Tokens per sample (a GPT's sequence length, else 1), which the data's samples depend on; None: not recorded."""


def encode(progress: Progress) -> torch.Tensor:
    """The record of ``progress``: step, epoch, batch and batch size, then seed and sample length where known
    (int64: a run's seeds are within it, see :data:`stagewise.run.config.SEEDS`)."""
    numbers = [progress.step, progress.epoch, progress.batch, progress.batch_size or 0]
    if progress.seed is not None and progress.sample_length is not None:
        numbers += [progress.seed, progress.sample_length]
    return torch.tensor(numbers, dtype=torch.int64)


def decode(record: torch.Tensor) -> Progress:
    """The :class:`Progress` that :func:`encode` wrote (3, 4 or 6 numbers, as older checkpoints recorded)."""
    step, epoch, batch, *rest = (int(v) for v in record)
    order = (rest[1], rest[2]) if len(rest) >= 3 else (None, None)
    return Progress(step, epoch, batch, rest[0] if rest and rest[0] else None, *order)
