"""Checkpoints with torch.distributed.checkpoint, keyed by the unsplit model's names: verified, atomic, any split.

A package by concept: :mod:`~.saving` (the save and its background form),
:mod:`~.loading`, :mod:`~.exporting`, :mod:`~.folders` (which checkpoint to
trust, rotation, the writer's lock), :mod:`~.manifest` (sizes and checksums),
:mod:`~.safe_reader` (reading without running anything) and
:mod:`~.progress` (the training position a checkpoint records).
"""

from stagewise.checkpoint.errors import CheckpointError
from stagewise.checkpoint.exporting import ExportFormat, export
from stagewise.checkpoint.folders import Choice, Refused, choose, latest
from stagewise.checkpoint.loading import load, progress_of
from stagewise.checkpoint.manifest import verify
from stagewise.checkpoint.progress import Progress
from stagewise.checkpoint.saving import Checkpointer, save

__all__ = [
    "CheckpointError",
    "Checkpointer",
    "Choice",
    "ExportFormat",
    "Progress",
    "Refused",
    "choose",
    "export",
    "latest",
    "load",
    "progress_of",
    "save",
    "verify",
]
