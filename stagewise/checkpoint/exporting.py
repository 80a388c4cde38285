"""Exporting a checkpoint's model whole, under the unsplit model's names: a torch file, safetensors, or an HF folder."""

from __future__ import annotations

from pathlib import Path
from typing import Literal, get_args

import torch

from stagewise.checkpoint.errors import CheckpointError
from stagewise.checkpoint.loading import empty_like_stored
from stagewise.checkpoint.safe_reader import SafeReader, read_tensors
from stagewise.checkpoint.saving import MODEL
from stagewise.pipeline.pretrained import SavesPretrained, write_weights

ExportFormat = Literal["torch", "safetensors", "hf"]
"""What :func:`export` writes: a ``torch.save`` file, a ``.safetensors`` file, or a Hugging Face folder."""


def export(
    path: str | Path, out: str | Path, *, format: ExportFormat = "torch", config: SavesPretrained | None = None
) -> Path:
    """Write a checkpoint's model for the unsplit model, under its own names (no process group needed).

    - ``"torch"``: one ``state_dict`` file; load it with
      ``model.load_state_dict(torch.load(out, weights_only=True))``.
    - ``"safetensors"``: one ``.safetensors`` file with the same tensors.
    - ``"hf"``: a folder that ``from_pretrained`` loads: ``model.safetensors``
      and the ``config.json`` that ``config`` (the model's ``config``) writes.

    Every name of the model is written, both names of a tied weight too.
    """
    if format not in get_args(ExportFormat):
        raise ValueError(f"format must be one of {list(get_args(ExportFormat))}, got {format!r}")
    if format == "hf" and config is None:
        raise TypeError("format='hf' writes the model's config.json too: pass config=model.config")
    reader = SafeReader(Path(path))
    stored = reader.read_metadata().state_dict_metadata
    state = {k: empty_like_stored(v, k, torch.device("cpu")) for k, v in stored.items() if k.startswith(MODEL)}
    if not state:
        raise CheckpointError(f"the checkpoint {path} holds no model entries")
    read_tensors(state, reader, stored, alone=True)
    plain = {k[len(MODEL) :]: v for k, v in state.items()}
    if format == "torch":
        torch.save(plain, out)
        return Path(out)
    return write_weights(plain, out, config=config if format == "hf" else None)
