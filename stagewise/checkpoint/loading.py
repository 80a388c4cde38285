"""Loading a checkpoint saved in any split into this pipeline and optimizer, checked against the model first."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.tensor import DTensor

from stagewise.checkpoint import progress as record
from stagewise.checkpoint.errors import CheckpointError
from stagewise.checkpoint.safe_reader import SafeReader, read_tensors
from stagewise.checkpoint.saving import MODEL, OPTIM, OPTIMIZER
from stagewise.comm.agreement import everyone_agrees
from stagewise.pipeline import Pipeline
from stagewise.pipeline.parallel.tied_weights import local

log = logging.getLogger(__name__)


def _check_keys(mine: Iterable[str], everything: Iterable[str], stored: Mapping[str, Any], path: Path) -> None:
    stored_model = {k[len(MODEL) :] for k in stored if k.startswith(MODEL)}
    missing = sorted(set(mine) - stored_model)
    unexpected = sorted(stored_model - set(everything))
    if missing or unexpected:
        raise CheckpointError(
            f"the checkpoint {path} does not fit this model: missing keys {missing[:10]}"
            f"{' ...' if len(missing) > 10 else ''}, unexpected keys {unexpected[:10]}"
            f"{' ...' if len(unexpected) > 10 else ''}; load a checkpoint of the same model"
        )


def empty_like_stored(meta: Any, key: str, device: torch.device, *, like: torch.Tensor | None = None) -> torch.Tensor:
    """A buffer for the stored entry ``key``: sharded like ``like`` where that is a DTensor of the same shape (DCP
    then reads this rank's shard alone), else whole on ``device``; an entry that is not a tensor is refused."""
    if not isinstance(meta, TensorStorageMetadata):
        raise CheckpointError(f"checkpoint entry {key} is a {type(meta).__name__}, not a tensor")
    if isinstance(like, DTensor) and tuple(like.shape) == tuple(meta.size):
        return torch.empty_like(like, dtype=meta.properties.dtype)
    return torch.empty(meta.size, dtype=meta.properties.dtype, device=device)


def _check_optimizer(
    optimizer: torch.optim.Optimizer, reader: SafeReader, stored: Mapping[str, Any], path: Path
) -> None:
    """Refuse state saved by another kind of optimizer (checkpoints from before it was recorded pass)."""
    if OPTIMIZER not in stored:
        return
    name = empty_like_stored(stored[OPTIMIZER], OPTIMIZER, torch.device("cpu"))
    read_tensors({OPTIMIZER: name}, reader, stored, alone=False)
    saved, mine = bytes(name.tolist()).decode(errors="replace"), type(optimizer).__name__
    if saved != mine:
        raise CheckpointError(
            f"the checkpoint {path} holds {saved} state, but the optimizer is {mine}; resume with {saved} "
            f"(stagewise train --optimizer {saved.lower()}), or start afresh in another checkpoint directory"
        )


def _held_ties(pipe: Pipeline, model_state: Mapping[str, torch.Tensor], stored: Mapping[str, Any]) -> list[list[str]]:
    """For each tied parameter this rank holds, the names it has in the checkpoint (two or more)."""
    out = []
    for tie in pipe.model_names.tied:
        names = [n for n in tie.names if MODEL + n in stored]
        if len(names) > 1 and any(n in model_state for n in tie.names):
            out.append(names)
    return out


def _optimizer_keys(pipe: Pipeline, stored: Mapping[str, Any]) -> dict[nn.Parameter, list[str]]:
    """The stored optimizer entries of each of this rank's parameters.

    A tied parameter's state was saved under whichever of its names the
    saving rank knew it by (each copy's own): any of them will do, its own
    name first, else the first in the model's order.
    """
    params = dict(pipe.named_parameters())
    aliases = {name: tie.names for tie in pipe.model_names.tied for name in tie.names}
    by_name: dict[str, list[str]] = {}
    for key in stored:
        if key.startswith(OPTIM):
            by_name.setdefault(key[len(OPTIM) :].rpartition("/")[0], []).append(key)
    wanted: dict[nn.Parameter, list[str]] = {}
    for name, param in params.items():
        found = next((n for n in (name, *aliases.get(name, ())) if n in by_name), None)
        if found is not None:
            wanted[param] = by_name[found]
    return wanted


def _check_shapes(model_state: Mapping[str, torch.Tensor], stored: Mapping[str, Any], path: Path) -> None:
    for name, tensor in model_state.items():
        size = getattr(stored[MODEL + name], "size", None)
        if size is not None and tuple(size) != tuple(tensor.shape):
            raise CheckpointError(
                f"the checkpoint {path} holds {name} with shape {tuple(size)}, but this model's is "
                f"{tuple(tensor.shape)}; load a checkpoint of the same model"
            )


@dataclass
class _Reading:
    """What one rank reads from a checkpoint: the buffers DCP fills, and where their values go afterwards."""

    state: dict[str, Any]
    """DCP's keys -> buffers to read into (the model's own tensors where they can be read in place)."""
    ties: list[list[str]]
    """The stored names of each tied parameter this rank holds, each read into a buffer of its own."""
    optimizer_keys: dict[nn.Parameter, list[str]]
    """Each parameter's optimizer-state keys."""
    rng: str | None
    """This rank's RNG state key, if it saved one."""
    cuda_rng: str | None = None
    """This rank's CUDA generator's state key, if it saved one and this rank runs on a GPU."""


def _reading(
    path: Path,
    pipe: Pipeline,
    model_state: Mapping[str, torch.Tensor],
    optimizer: torch.optim.Optimizer | None,
    reader: SafeReader,
    stored: Mapping[str, Any],
) -> _Reading:
    device = pipe.mesh.device
    state: dict[str, Any] = {MODEL + k: v for k, v in model_state.items()}
    ties = _held_ties(pipe, model_state, stored)
    for names in ties:  # each stored name of a tied parameter in a buffer of its own, to compare them
        held = next(model_state[n] for n in names if n in model_state)
        for name in names:
            state[MODEL + name] = empty_like_stored(stored[MODEL + name], MODEL + name, device, like=held)
    wanted: dict[nn.Parameter, list[str]] = {}
    if optimizer is not None:
        _check_optimizer(optimizer, reader, stored, path)
        wanted = _optimizer_keys(pipe, stored)
        for param, keys in wanted.items():
            for key in keys:
                scalar = not getattr(stored[key], "size", (0,))  # e.g. Adam's step stays on the CPU
                where = torch.device("cpu") if scalar else device
                state[key] = empty_like_stored(stored[key], key, where, like=param)
    if record.KEY not in stored:
        raise CheckpointError(f"{path} holds no training progress: it is not a stagewise checkpoint")
    state[record.KEY] = empty_like_stored(stored[record.KEY], record.KEY, torch.device("cpu"))
    rank = dist.get_rank() if dist.is_initialized() else 0
    rng, cuda_rng = f"rng/{rank}", f"cuda_rng/{rank}"
    if rng in stored:
        state[rng] = empty_like_stored(stored[rng], rng, torch.device("cpu"))
    on_gpu = cuda_rng in stored and device.type == "cuda"
    if on_gpu:  # a GPU's generator state, read on the CPU as torch.cuda.set_rng_state takes it
        state[cuda_rng] = empty_like_stored(stored[cuda_rng], cuda_rng, torch.device("cpu"))
    return _Reading(state, ties, wanted, rng if rng in stored else None, cuda_rng if on_gpu else None)


def _apply(
    read: _Reading,
    path: Path,
    pipe: Pipeline,
    model_state: Mapping[str, torch.Tensor],
    optimizer: torch.optim.Optimizer | None,
) -> None:
    """Copy what ``read`` holds that was not read in place: tied parameters, optimizer state, the RNG state."""
    state, ties = read.state, read.ties
    differ = [
        names
        for names in ties
        if not all(torch.equal(local(state[MODEL + names[0]]), local(state[MODEL + n])) for n in names)
    ]
    if not everyone_agrees(not differ, pipe.mesh.device):
        raise CheckpointError(
            f"the checkpoint {path} holds different values for {', '.join(differ[0]) if differ else 'parameters'} "
            "that this model ties into one (on some rank): it was saved from a model that does not tie them; "
            "load a checkpoint of the same model"
        )
    with torch.no_grad():
        for names in ties:
            for name in names:
                if name in model_state:
                    model_state[name].copy_(state[MODEL + names[0]])
    if optimizer is not None:
        for param, keys in read.optimizer_keys.items():
            optimizer.state[param] = {k.rpartition("/")[2]: state[k] for k in keys}
    if read.rng is not None:
        torch.set_rng_state(state[read.rng])
    if read.cuda_rng is not None:
        torch.cuda.set_rng_state(state[read.cuda_rng], pipe.mesh.device)


def load(path: str | Path, pipe: Pipeline, optimizer: torch.optim.Optimizer | None = None) -> record.Progress:
    """Load a checkpoint saved with any split into this pipeline (and optimizer); every rank calls it.

    Each rank reads only its own parameters' entries, each required to be a
    tensor (nothing in a checkpoint is unpickled beyond its allow-listed
    index). The model must be the same: missing or unexpected keys and shape
    mismatches are a :class:`CheckpointError` naming them. The RNG state is
    restored when this rank saved one. Returns the progress to resume from.
    """
    path = Path(path)
    reader = SafeReader(path)
    stored = reader.read_metadata().state_dict_metadata
    model_state = pipe.state_dict()
    _check_keys(model_state, pipe.model_names.keys, stored, path)
    _check_shapes(model_state, stored, path)
    read = _reading(path, pipe, model_state, optimizer, reader, stored)
    read_tensors(read.state, reader, stored, alone=False)
    _apply(read, path, pipe, model_state, optimizer)
    progress = record.decode(read.state[record.KEY])
    log.info("loaded %s: step %d", path, progress.step)
    return progress


def progress_of(path: str | Path) -> record.Progress:
    """The training progress a checkpoint recorded, read alone in this process (no process group needed): what
    a launcher checks a resume against before it starts any process."""
    reader = SafeReader(Path(path))
    stored = reader.read_metadata().state_dict_metadata
    if record.KEY not in stored:
        raise CheckpointError(f"{path} holds no training progress: it is not a stagewise checkpoint")
    state = {record.KEY: empty_like_stored(stored[record.KEY], record.KEY, torch.device("cpu"))}
    read_tensors(state, reader, stored, alone=True)
    return record.decode(state[record.KEY])
