"""Reading a checkpoint without running anything in it: the index unpickled by an exact allow-list, tensors only.

A DCP checkpoint is an index (``.metadata``, a pickle) and data files. The
index is unpickled here by :class:`SafeReader` with an allow-list of exact
``(module, name)`` pairs: DCP's own metadata classes, ``torch.Size``, torch's
dtypes and the few helpers its pickle names, and nothing else; a dotted name
(which a protocol-4 pickle would follow attribute by attribute, out of an
allowed module into ``os``) is never allowed. The data files hold tensors as
raw bytes, except entries DCP stores as "bytes", which it would read with
``torch.load(weights_only=False)``: :class:`TensorsOnly` refuses every such
entry, and :func:`read_tensors` refuses any requested entry that is not a
tensor before a byte of data is read.
"""

from __future__ import annotations

import io
import pickle
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

from stagewise.checkpoint.errors import CheckpointError, reason

_METADATA = "torch.distributed.checkpoint.metadata"
ALLOWED: frozenset[tuple[str, str]] = frozenset(
    {
        *(
            (_METADATA, name)
            for name in (
                "Metadata",
                "MetadataIndex",
                "StorageMeta",
                "TensorStorageMetadata",
                "BytesStorageMetadata",
                "ChunkStorageMetadata",
                "TensorProperties",
                "_MEM_FORMAT_ENCODING",
            )
        ),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),  # maps a layout's name to torch.strided etc.
        ("pathlib", "PosixPath"),
        ("pathlib", "WindowsPath"),
        ("collections", "OrderedDict"),
        *(("torch", name) for name in dir(torch) if isinstance(getattr(torch, name, None), torch.dtype)),
    }
)
"""Every ``(module, name)`` a checkpoint's index may name: exact pairs, none of them dotted."""


class _IndexUnpickler(pickle.Unpickler):
    """Unpickles DCP's ``.metadata`` index and nothing else (see :data:`ALLOWED`)."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in a checkpoint's metadata")


class SafeReader(FileSystemReader):
    """DCP's file reader, whose index is unpickled with an exact allow-list instead of plain pickle."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = Path(self.path) / ".metadata"
        try:
            with path.open("rb") as file:
                metadata = _IndexUnpickler(file).load()
        except FileNotFoundError as err:
            raise CheckpointError(f"{self.path} is not a complete checkpoint: it has no .metadata") from err
        except (pickle.UnpicklingError, EOFError, AttributeError, ValueError, TypeError, IndexError) as err:
            raise CheckpointError(f"the checkpoint index {path} is corrupt or truncated: {err}") from err
        if not isinstance(metadata, Metadata):
            raise CheckpointError(f"{path} holds a {type(metadata).__name__}, not a checkpoint index")
        return metadata


class TensorsOnly(DefaultLoadPlanner):
    """DCP's load planner, refusing the entries it would read with ``torch.load(weights_only=False)``."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        raise CheckpointError(
            f"checkpoint entry {read_item.dest_index.fqn} is stored as pickled bytes, which stagewise never loads; "
            "a stagewise checkpoint holds tensors only"
        )


def require_tensors(keys: Any, stored: Mapping[str, Any], path: Path) -> None:
    """Refuse, before any data is read, a requested entry that the index does not describe as a tensor."""
    for key in keys:
        if key in stored and not isinstance(stored[key], TensorStorageMetadata):
            raise CheckpointError(
                f"checkpoint entry {key} of {path} is a {type(stored[key]).__name__}, not a tensor; stagewise reads "
                "tensors only (this checkpoint was not written by stagewise, or was altered)"
            )


def read_tensors(state: dict[str, Any], reader: SafeReader, stored: Mapping[str, Any], *, alone: bool) -> None:
    """DCP's load of ``state`` through ``reader`` (every rank together, or ``alone`` in this process), tensors
    only; a failure is a :class:`CheckpointError` with its first reason."""
    path = Path(reader.path)
    require_tensors(state, stored, path)
    try:
        if alone:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
                dcp_load(state, storage_reader=reader, planner=TensorsOnly(), no_dist=True)
        else:
            dcp_load(state, storage_reader=reader, planner=TensorsOnly())
    except CheckpointError:
        raise
    except (Exception, CheckpointException) as err:  # DCP gathers every rank's failure in a BaseException
        inner = getattr(err, "failures", None)
        first = next(iter(inner.values()), None) if isinstance(inner, dict) else None
        first = getattr(first, "exception", first)
        if isinstance(first, CheckpointError):
            raise first from err
        raise CheckpointError(f"reading the checkpoint {path} failed (corrupt or truncated?): {reason(err)}") from err
