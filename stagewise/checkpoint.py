"""Checkpoints with torch.distributed.checkpoint, keyed by the unsplit model's names: atomic, loaded into any split."""

from __future__ import annotations

import logging
import os
import pickle
import re
import shutil
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, get_args

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.distributed.tensor import DTensor

from stagewise.comm import everyone_agrees
from stagewise.pipeline import Pipeline
from stagewise.pipeline.pretrained import SavesPretrained, write_weights
from stagewise.pipeline.tied_weights import local

log = logging.getLogger(__name__)

_NAME = re.compile(r"^step-(\d{8})$")
MODEL, OPTIM, PROGRESS = "model/", "optim/", "progress"
OPTIMIZER = "optimizer"
"""The optimizer's class name, as UTF-8 bytes in a uint8 tensor."""


class CheckpointError(ValueError):
    """A checkpoint that cannot be used: missing, incomplete, corrupt, or from a different model."""


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


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's ``.metadata`` file and nothing else: only its own classes and torch's dtypes."""

    _MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem")
    _NAMES = (
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),  # maps a layout's name to torch.strided etc.
        ("pathlib", "PosixPath"),
        ("pathlib", "WindowsPath"),
        ("collections", "OrderedDict"),
    )

    def find_class(self, module: str, name: str) -> Any:
        if module in self._MODULES or (module, name) in self._NAMES:
            return super().find_class(module, name)
        kinds = (torch.dtype, torch.layout, torch.memory_format)
        if module == "torch" and isinstance(getattr(torch, name, None), kinds):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in a checkpoint's metadata")


class SafeReader(FileSystemReader):
    """DCP's file reader, whose metadata is unpickled with an allow-list instead of plain pickle.

    Tensor data is read as raw bytes by DCP itself; only the ``.metadata``
    index is a pickle, and here it may hold DCP's own metadata classes and
    nothing that could run code.
    """

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = Path(self.path) / ".metadata"
        try:
            with path.open("rb") as file:
                metadata = _MetadataUnpickler(file).load()
        except FileNotFoundError as err:
            raise CheckpointError(f"{self.path} is not a complete checkpoint: it has no .metadata") from err
        except (pickle.UnpicklingError, EOFError, AttributeError, ValueError) as err:
            raise CheckpointError(f"the checkpoint index {path} is corrupt or truncated: {err}") from err
        if not isinstance(metadata, Metadata):
            raise CheckpointError(f"{path} holds a {type(metadata).__name__}, not a checkpoint index")
        return metadata


def complete(directory: str | Path) -> list[Path]:
    """The complete checkpoints under ``directory``, oldest first (a save that was cut off does not count)."""
    root = Path(directory)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if _NAME.match(p.name) and (p / ".metadata").is_file()]
    return sorted(found, key=lambda p: p.name)


def latest(directory: str | Path) -> Path | None:
    """The newest complete checkpoint under ``directory``, or None."""
    done = complete(directory)
    return done[-1] if done else None


def _optimizer_state(pipe: Pipeline, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    names = {id(p): n for n, p in pipe.named_parameters()}
    out: dict[str, torch.Tensor] = {}
    for param, state in optimizer.state.items():
        name = names.get(id(param))
        if name is None:
            raise ValueError("the optimizer holds a parameter that is not one of this pipeline's; pass its optimizer")
        for key, value in state.items():
            tensor = value if isinstance(value, torch.Tensor) else torch.tensor(value)
            out[f"{OPTIM}{name}/{key}"] = tensor
    return out


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def save(
    directory: str | Path,
    pipe: Pipeline,
    optimizer: torch.optim.Optimizer | None,
    progress: Progress,
    *,
    keep: int = 2,
) -> Path:
    """Save this step's model, optimizer state, progress and RNG states; every rank calls it.

    Written with torch.distributed.checkpoint into ``step-NNNNNNNN.partial``
    and renamed to ``step-NNNNNNNN`` once every rank's part and the index are
    on disk, so a save that is cut off leaves the previous checkpoint the
    latest. Keys are the unsplit model's names (``model/blocks.3.fc.weight``,
    ``optim/blocks.3.fc.weight/exp_avg``), so the checkpoint loads into any
    split. A parameter sharded by FSDP or tensor parallelism (a DTensor) is
    written shard by shard, by the ranks that hold it, as the one tensor it is
    in the unsplit model: a checkpoint saved in one layout loads into any
    other (``pp x dp x fsdp x tp``), and :func:`export` writes it whole. Only
    the newest ``keep`` checkpoints are kept.
    """
    root = Path(directory)
    final = root / f"step-{progress.step:08d}"
    partial = final.with_name(final.name + ".partial")
    rank = dist.get_rank() if dist.is_initialized() else 0
    problem = ""
    if rank == 0:
        try:
            root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(partial, ignore_errors=True)
            partial.mkdir()
        except OSError as err:
            problem = f": {err}"
    if not everyone_agrees(not problem, pipe.device):
        raise CheckpointError(
            f"rank 0 cannot write checkpoints to {root}{problem}; choose a writable checkpoint directory"
        )
    state: dict[str, Any] = {MODEL + k: v for k, v in pipe.state_dict().items()}
    if optimizer is not None:
        state.update(_optimizer_state(pipe, optimizer))
        state[OPTIMIZER] = torch.tensor(list(type(optimizer).__name__.encode()), dtype=torch.uint8)
    position = [progress.step, progress.epoch, progress.batch, progress.batch_size or 0]
    if progress.seed is not None and progress.sample_length is not None:
        position += [progress.seed, progress.sample_length]
    state[PROGRESS] = torch.tensor(position, dtype=torch.int64)
    state[f"rng/{rank}"] = torch.get_rng_state()
    if pipe.device.type == "cuda":  # dropout on the GPU draws from the device's generator
        state[f"cuda_rng/{rank}"] = torch.cuda.get_rng_state(pipe.device)
    dcp_save(state, storage_writer=FileSystemWriter(partial))
    _barrier()
    if rank == 0:
        if final.exists():  # saved again: set the old one aside whole, so no half-deleted folder ever looks complete
            stale = final.with_name(final.name + ".old")
            shutil.rmtree(stale, ignore_errors=True)
            os.replace(final, stale)
        os.replace(partial, final)
        for left in root.glob("step-*.*"):  # saves cut off before, and folders set aside
            if left.is_dir() and left.suffix in (".partial", ".old"):
                shutil.rmtree(left, ignore_errors=True)
        for old in complete(root)[:-keep] if keep > 0 else []:
            if old != final:  # never the one just written, whatever newer ones lie beside it
                shutil.rmtree(old, ignore_errors=True)
        log.info("saved %s", final)
    _barrier()
    return final


def _reason(err: BaseException) -> str:
    """The first underlying failure of a DCP error, in one line."""
    failures = getattr(err, "failures", None)
    inner: object = next(iter(failures.values())) if isinstance(failures, dict) and failures else err
    inner = inner[0] if isinstance(inner, tuple) and inner else getattr(inner, "exception", inner)
    text = str(inner).strip().splitlines()
    return f"{type(inner).__name__}{': ' + text[0] if text else ''}"


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


def _empty_like_stored(meta: Any, key: str, device: torch.device, *, like: torch.Tensor | None = None) -> torch.Tensor:
    """A buffer for the stored entry ``key``: sharded like ``like`` where that is a DTensor of the same shape (DCP
    then reads this rank's shard alone), else whole on ``device``."""
    if not isinstance(meta, TensorStorageMetadata):
        raise CheckpointError(f"checkpoint entry {key} is not a tensor")
    if isinstance(like, DTensor) and tuple(like.shape) == tuple(meta.size):
        return torch.empty_like(like, dtype=meta.properties.dtype)
    return torch.empty(meta.size, dtype=meta.properties.dtype, device=device)


def _check_optimizer(
    optimizer: torch.optim.Optimizer, reader: SafeReader, stored: Mapping[str, Any], path: Path
) -> None:
    """Refuse state saved by another kind of optimizer (checkpoints from before it was recorded pass)."""
    if OPTIMIZER not in stored:
        return
    name = torch.empty(stored[OPTIMIZER].size, dtype=torch.uint8)
    dcp_load({OPTIMIZER: name}, storage_reader=reader)
    saved, mine = bytes(name.tolist()).decode(), type(optimizer).__name__
    if saved != mine:
        raise CheckpointError(
            f"the checkpoint {path} holds {saved} state, but the optimizer is {mine}; resume with {saved} "
            f"(stagewise train --optimizer {saved.lower()}), or start afresh in another checkpoint directory"
        )


def _held_ties(pipe: Pipeline, model_state: Mapping[str, torch.Tensor], stored: Mapping[str, Any]) -> list[list[str]]:
    """For each tied parameter this rank holds, the names it has in the checkpoint (two or more)."""
    out = []
    for tie in pipe.ties.shared:
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
    aliases = {name: tie.names for tie in pipe.ties.shared for name in tie.names}
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
    device = pipe.device
    state: dict[str, Any] = {MODEL + k: v for k, v in model_state.items()}
    ties = _held_ties(pipe, model_state, stored)
    for names in ties:  # each stored name of a tied parameter in a buffer of its own, to compare them
        held = next(model_state[n] for n in names if n in model_state)
        for name in names:
            state[MODEL + name] = _empty_like_stored(stored[MODEL + name], MODEL + name, device, like=held)
    wanted: dict[nn.Parameter, list[str]] = {}
    if optimizer is not None:
        _check_optimizer(optimizer, reader, stored, path)
        wanted = _optimizer_keys(pipe, stored)
        for param, keys in wanted.items():
            for key in keys:
                scalar = not getattr(stored[key], "size", (0,))  # e.g. Adam's step stays on the CPU
                where = torch.device("cpu") if scalar else device
                state[key] = _empty_like_stored(stored[key], key, where, like=param)
    if PROGRESS not in stored:
        raise CheckpointError(f"{path} holds no training progress: it is not a stagewise checkpoint")
    state[PROGRESS] = _empty_like_stored(stored[PROGRESS], PROGRESS, torch.device("cpu"))
    rank = dist.get_rank() if dist.is_initialized() else 0
    rng, cuda_rng = f"rng/{rank}", f"cuda_rng/{rank}"
    if rng in stored:
        state[rng] = _empty_like_stored(stored[rng], rng, torch.device("cpu"))
    on_gpu = cuda_rng in stored and device.type == "cuda"
    if on_gpu:  # a GPU's generator state, read on the CPU as torch.cuda.set_rng_state takes it
        state[cuda_rng] = _empty_like_stored(stored[cuda_rng], cuda_rng, torch.device("cpu"))
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
    if not everyone_agrees(not differ, pipe.device):
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
        torch.cuda.set_rng_state(state[read.cuda_rng], pipe.device)


def load(path: str | Path, pipe: Pipeline, optimizer: torch.optim.Optimizer | None = None) -> Progress:
    """Load a checkpoint saved with any split into this pipeline (and optimizer); every rank calls it.

    Each rank reads only its own parameters' entries. The model must be the
    same: missing or unexpected keys and shape mismatches are a
    :class:`CheckpointError` naming them. The RNG state is restored when
    this rank saved one. Returns the progress to resume from.
    """
    path = Path(path)
    reader = SafeReader(path)
    stored = reader.read_metadata().state_dict_metadata
    model_state = pipe.state_dict()
    _check_keys(model_state, pipe.model_keys, stored, path)
    _check_shapes(model_state, stored, path)
    read = _reading(path, pipe, model_state, optimizer, reader, stored)
    try:
        dcp_load(read.state, storage_reader=reader)
    except (Exception, CheckpointException) as err:  # DCP gathers every rank's failure in a BaseException
        raise CheckpointError(f"reading the checkpoint {path} failed (corrupt or truncated?): {_reason(err)}") from err
    _apply(read, path, pipe, model_state, optimizer)
    progress = _progress(read.state[PROGRESS])
    log.info("loaded %s: step %d", path, progress.step)
    return progress


def _progress(recorded: torch.Tensor) -> Progress:
    step, epoch, batch, *rest = (int(v) for v in recorded)  # 3 numbers, 4 or 6 as recorded
    order = (rest[1], rest[2]) if len(rest) >= 3 else (None, None)
    return Progress(step, epoch, batch, rest[0] if rest and rest[0] else None, *order)


def _load_alone(state: dict[str, Any], reader: SafeReader) -> None:
    """DCP's load into ``state`` in this process alone, whether or not a process group exists."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
        dcp_load(state, storage_reader=reader, no_dist=True)


def progress_of(path: str | Path) -> Progress:
    """The training progress a checkpoint recorded, read alone in this process (no process group needed): what
    a launcher checks a resume against before it starts any process."""
    reader = SafeReader(Path(path))
    stored = reader.read_metadata().state_dict_metadata
    if PROGRESS not in stored:
        raise CheckpointError(f"{path} holds no training progress: it is not a stagewise checkpoint")
    state = {PROGRESS: _empty_like_stored(stored[PROGRESS], PROGRESS, torch.device("cpu"))}
    try:
        _load_alone(state, reader)
    except (Exception, CheckpointException) as err:
        raise CheckpointError(f"reading the checkpoint {path} failed (corrupt or truncated?): {_reason(err)}") from err
    return _progress(state[PROGRESS])


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
    state = {k: _empty_like_stored(v, k, torch.device("cpu")) for k, v in stored.items() if k.startswith(MODEL)}
    if not state:
        raise CheckpointError(f"the checkpoint {path} holds no model entries")
    _load_alone(state, reader)
    plain = {k[len(MODEL) :]: v for k, v in state.items()}
    if format == "torch":
        torch.save(plain, out)
        return Path(out)
    return write_weights(plain, out, config=config if format == "hf" else None)
