"""Pretrained weights in safetensors: read per stage (a rank reads its own tensors), written for ``from_pretrained``."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

from stagewise.errors import StagewiseError

if TYPE_CHECKING:
    from stagewise.pipeline.pipe import Pipeline

log = logging.getLogger(__name__)

INDEX = "model.safetensors.index.json"
"""The index of a sharded ``save_pretrained`` folder: which file holds each tensor."""
SINGLE = "model.safetensors"


class PretrainedError(StagewiseError, ValueError):
    """Pretrained weights that cannot be read into a pipeline; the message says which file or names, and why."""


@dataclass(frozen=True)
class PretrainedLoad:
    """What :func:`load_pretrained` read on this rank."""

    names: tuple[str, ...]
    """The tensors of this rank's stages that were set, under the model's names."""
    bytes_read: int
    """The bytes of the tensors read from the files: this rank's share of the model."""
    files: tuple[Path, ...]
    """The files this rank opened (only those that hold one of its tensors)."""


def weight_files(path: str | Path) -> dict[str, Path]:
    """Which file holds each tensor of pretrained weights at ``path``: a ``.safetensors`` file, or a folder as
    ``save_pretrained`` writes it (``model.safetensors``, or shards listed in ``model.safetensors.index.json``).

    Only the files' headers are read.
    """
    from safetensors import safe_open

    where = Path(path)
    if where.is_dir():
        index = where / INDEX
        if index.is_file():
            mapping = json.loads(index.read_text()).get("weight_map")
            if not isinstance(mapping, dict):
                raise PretrainedError(f"{index} has no weight_map; is it a save_pretrained index?")
            return {str(name): where / str(file) for name, file in mapping.items()}
        files = [where / SINGLE] if (where / SINGLE).is_file() else sorted(where.glob("*.safetensors"))
        if not files:
            found = sorted(p.name for p in where.iterdir())[:8]
            hint = (
                " (pickled .bin weights: save them again with safe_serialization)"
                if any(n.endswith(".bin") for n in found)
                else ""
            )
            raise PretrainedError(f"{where} holds no .safetensors weights{hint}; it holds {found}")
    elif where.is_file() and where.suffix == ".safetensors":
        files = [where]
    else:
        raise PretrainedError(
            f"{where} is neither a .safetensors file nor a folder of them; pass what save_pretrained wrote"
        )
    out: dict[str, Path] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as reader:
            for name in reader.keys():  # noqa: SIM118 (a reader, not a dict)
                out[name] = file
    return out


def _ties(state: Mapping[str, torch.Tensor]) -> list[list[str]]:
    """The names of ``state`` grouped by the tensor they name: a head tied to an embedding is one group."""
    groups: dict[tuple[int, int, tuple[int, ...]], list[str]] = {}
    for name, whole in state.items():
        tensor = whole.to_local() if isinstance(whole, DTensor) else whole  # a sharded one: this rank's shard
        key = (tensor.untyped_storage().data_ptr(), int(tensor.storage_offset()), tuple(whole.shape))
        groups.setdefault(key, []).append(name)
    return list(groups.values())


@dataclass(frozen=True)
class _Source:
    names: list[str]
    """Every name of one tensor of this rank."""
    stored: str
    """The name it is stored under."""
    file: Path


def _sources(groups: Iterable[list[str]], stored: Mapping[str, Path]) -> tuple[list[_Source], list[str]]:
    """Where each tensor is stored (under any of its names), and the names of those stored nowhere."""
    found: list[_Source] = []
    missing: list[str] = []
    for names in groups:
        source = next((n for n in names if n in stored), None)
        if source is None:
            missing.extend(names)
        else:
            found.append(_Source(names, source, stored[source]))
    return found, missing


def _read_into(state: Mapping[str, torch.Tensor], file: Path, sources: Iterable[_Source]) -> int:
    """Copy each of ``sources`` from ``file`` into its tensor of ``state``; the bytes read."""
    from safetensors import safe_open

    read = 0
    with safe_open(str(file), framework="pt", device="cpu") as reader, torch.no_grad():
        for source in sources:
            value = reader.get_tensor(source.stored)
            target = state[source.names[0]]
            if value.shape != target.shape:
                raise PretrainedError(
                    f"{source.stored} in {file} has shape {tuple(value.shape)}, but the model's {source.names[0]} "
                    f"has {tuple(target.shape)}; are these the weights of this model's config?"
                )
            if isinstance(target, DTensor):  # this rank's shard of it, cut here: no communication
                value = distribute_tensor(value, target.device_mesh, target.placements, src_data_rank=None)
                target.to_local().copy_(value.to_local())
            else:
                target.copy_(value)
            read += value.numel() * value.element_size()
    return read


def load_pretrained(pipe: Pipeline, path: str | Path, *, strict: bool = True) -> PretrainedLoad:
    """Set this rank's parameters and buffers from pretrained weights, reading only its own tensors.

    ``path`` is a ``save_pretrained`` folder (``model.safetensors``, or shards
    with their index) or a ``.safetensors`` file, under the model's own names.
    safetensors reads each tensor on its own from the memory-mapped file, so
    a rank reads its stages' share of the model and never the rest. A name
    stored once for tied tensors (GPT-2 stores ``transformer.wte.weight``, not
    ``lm_head.weight``) sets every name of the tie. Call it on every rank
    after building the :class:`~stagewise.Pipeline` (the layers may have
    been on the meta device) and before training.

    Args:
        pipe: the pipeline whose stages on this rank are set.
        path: the weights.
        strict: refuse a tensor of this rank's stages that the weights lack (otherwise it keeps its initial
            value, and is logged).

    Raises:
        PretrainedError: no weights at ``path``, a tensor missing (with ``strict``), or one of another shape.
    """
    stored = weight_files(path)
    state = pipe.state_dict()
    sources, missing = _sources(_ties(state), stored)
    if missing and strict:
        raise PretrainedError(
            f"the weights at {path} lack {len(missing)} tensors of this rank's stages: {sorted(missing)[:5]}; pass "
            "strict=False to keep their initial values"
        )
    if missing:
        log.warning("the weights at %s lack %d tensors, kept as initialised: %s", path, len(missing), missing[:5])
    by_file: dict[Path, list[_Source]] = {}
    for source in sources:
        by_file.setdefault(source.file, []).append(source)
    read = sum(_read_into(state, file, here) for file, here in by_file.items())
    names = tuple(sorted(n for source in sources for n in source.names))
    log.info("read %d tensors (%d bytes) from %d files at %s", len(sources), read, len(by_file), path)
    return PretrainedLoad(names, read, tuple(sorted(by_file)))


class SavesPretrained(Protocol):
    """A Hugging Face config (``model.config``): it writes ``config.json`` into a folder."""

    def save_pretrained(self, save_directory: str | os.PathLike[str]) -> object: ...


def write_weights(state: Mapping[str, torch.Tensor], out: str | Path, *, config: SavesPretrained | None = None) -> Path:
    """Write ``state`` as one ``.safetensors`` file at ``out``; with ``config``, ``out`` is a folder that
    ``from_pretrained`` loads: ``config.json`` and ``model.safetensors``. Returns ``out``."""
    from safetensors.torch import save_file

    target = Path(out)
    if config is not None:
        target.mkdir(parents=True, exist_ok=True)
        config.save_pretrained(target)
        target = target / SINGLE
    save_file({k: v.contiguous() for k, v in state.items()}, str(target), metadata={"format": "pt"})
    return Path(out)
