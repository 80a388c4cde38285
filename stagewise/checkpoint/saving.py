"""Saving a checkpoint: DCP into a partial folder, the manifest, one atomic rename, rotation; or in the background.

Every save goes the same way: rank 0 makes ``step-N.partial``; every rank
writes its part with DCP and records its files in the manifest; rank 0 seals
the manifest and renames the folder to ``step-N`` (the moment the checkpoint
becomes complete), then rotates the older ones away. A save that fails on any
rank fails on every rank with the reason (disk full, permission, I/O error,
naming the path); the partial folder is removed and the previous checkpoint
stays the latest. :class:`Checkpointer` runs the same save in the background
after staging the state in host memory (DCP's ``async_save``), at most one in
flight.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import shutil
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.distributed.checkpoint.state_dict_saver import async_save as dcp_async_save
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from stagewise.checkpoint import progress as record
from stagewise.checkpoint.errors import CheckpointError, reason
from stagewise.checkpoint.folders import rotate, set_aside, step_folder
from stagewise.checkpoint.manifest import record_part, seal, sync_folder
from stagewise.pipeline import Pipeline
from stagewise.units import format_bytes

log = logging.getLogger(__name__)

MODEL, OPTIM = "model/", "optim/"
OPTIMIZER = "optimizer"
"""The optimizer's class name, as UTF-8 bytes in a uint8 tensor."""


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


def _rank(group: dist.ProcessGroup | None = None) -> int:
    return dist.get_rank(group) if dist.is_initialized() else 0


def state_of(
    pipe: Pipeline, optimizer: torch.optim.Optimizer | None, progress: record.Progress
) -> dict[str, torch.Tensor]:
    """What a checkpoint holds of this rank, under the unsplit model's names: the model's entries, the optimizer's
    state and class name, the progress record and this rank's RNG states (the device's too, on a GPU)."""
    rank = _rank()
    state: dict[str, torch.Tensor] = {MODEL + k: v for k, v in pipe.state_dict().items()}
    if optimizer is not None:
        state.update(_optimizer_state(pipe, optimizer))
        state[OPTIMIZER] = torch.tensor(list(type(optimizer).__name__.encode()), dtype=torch.uint8)
    state[record.KEY] = record.encode(progress)
    state[f"rng/{rank}"] = torch.get_rng_state()
    if pipe.mesh.device.type == "cuda":  # dropout on the GPU draws from the device's generator
        state[f"cuda_rng/{rank}"] = torch.cuda.get_rng_state(pipe.mesh.device)
    return state


@dataclass(frozen=True)
class _Target:
    """Where one save goes."""

    root: Path
    step: int
    keep: int

    @property
    def final(self) -> Path:
        return step_folder(self.root, self.step)

    @property
    def partial(self) -> Path:
        return self.final.with_name(self.final.name + ".partial")


def _agreed(problem: str, device: torch.device, group: dist.ProcessGroup | None) -> bool:
    if not dist.is_initialized():
        return not problem
    flag = torch.tensor([0 if problem else 1], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())


def _begin(target: _Target, device: torch.device, group: dist.ProcessGroup | None) -> None:
    """Rank 0 makes the partial folder (replacing one a cut-off save left); every rank learns whether it could."""
    problem = ""
    if _rank(group) == 0:
        try:
            target.root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(target.partial, ignore_errors=True)
            target.partial.mkdir()
        except OSError as err:
            problem = f": {err}"
    if not _agreed(problem, device, group):
        raise CheckpointError(
            f"rank 0 cannot write checkpoints to {target.root}{problem}; choose a writable checkpoint directory"
        )


def _space(root: Path) -> str:
    """How much room is left where ``root`` is (a full disk fails a write with whatever error the writer makes of
    it, not always "No space left on device")."""
    try:
        return f" ({format_bytes(shutil.disk_usage(root).free)} free there)"
    except OSError:
        return ""


def _failed(target: _Target, problem: str, device: torch.device, group: dist.ProcessGroup | None) -> None:
    """Every rank learns whether any failed; then rank 0 removes the partial folder and every rank raises, the
    one that failed with its reason."""
    if problem:  # now: once the partial folder goes, the room it took is free again
        problem += _space(target.root)
    if _agreed(problem, device, group):
        return
    if _rank(group) == 0:
        shutil.rmtree(target.partial, ignore_errors=True)
    kept = "the previous checkpoint stays the latest"
    raise CheckpointError(
        f"saving the checkpoint {target.final} failed: {problem}; {kept}"
        if problem
        else f"saving the checkpoint {target.final} failed on another rank (its error names the cause); {kept}"
    )


def _finish(target: _Target, device: torch.device, group: dist.ProcessGroup | None) -> None:
    """After DCP wrote every rank's part: manifests, the atomic rename, rotation."""
    problem = ""
    try:
        record_part(target.partial, _rank(group))
    except OSError as err:
        problem = f"{type(err).__name__}: {err}"
    _failed(target, problem, device, group)
    if _rank(group) == 0:
        try:
            seal(target.partial, dist.get_world_size(group) if dist.is_initialized() else 1, target.step)
            if target.final.exists():  # saved again: set the old one aside whole, so no half-deleted one looks complete
                set_aside(target.final)
            os.replace(target.partial, target.final)
            sync_folder(target.root)
        except OSError as err:
            problem = f"{type(err).__name__}: {err}"
    _failed(target, problem, device, group)
    if _rank(group) == 0:
        try:
            rotate(target.root, target.keep, target.final)
        except OSError as err:  # the checkpoint is complete; an old one left behind is only space
            log.warning("rotating the checkpoints in %s: %s", target.root, err)
        log.info("saved %s", target.final)


def _written(state: dict[str, Any], target: _Target, device: torch.device, group: dist.ProcessGroup | None) -> None:
    try:
        dcp_save(state, storage_writer=FileSystemWriter(target.partial), process_group=group)
    except (Exception, CheckpointException) as err:  # DCP gathers every rank's failure in a BaseException
        _failed(target, reason(err), device, group)
    _finish(target, device, group)


def save(
    directory: str | Path,
    pipe: Pipeline,
    optimizer: torch.optim.Optimizer | None,
    progress: record.Progress,
    *,
    keep: int = 2,
) -> Path:
    """Save this step's model, optimizer state, progress and RNG states; every rank calls it.

    Written with torch.distributed.checkpoint into ``step-NNNNNNNN.partial``,
    recorded in a manifest (each file's size and CRC-32) and renamed to
    ``step-NNNNNNNN`` once every rank's part, the index and the manifest are
    on disk, so a save that is cut off or fails leaves the previous checkpoint
    the latest (a failure raises :class:`CheckpointError` with its reason on
    every rank). Keys are the unsplit model's names
    (``model/blocks.3.fc.weight``, ``optim/blocks.3.fc.weight/exp_avg``), so
    the checkpoint loads into any split. A parameter sharded by FSDP or tensor
    parallelism (a DTensor) is written shard by shard, by the ranks that hold
    it, as the one tensor it is in the unsplit model: a checkpoint saved in
    one layout loads into any other (``pp x dp x fsdp x tp``), and
    :func:`~stagewise.checkpoint.export` writes it whole. Only the newest
    ``keep`` checkpoints are kept (older ones renamed aside, then deleted).
    """
    target = _Target(Path(directory), progress.step, keep)
    _begin(target, pipe.mesh.device, None)
    _written(state_of(pipe, optimizer, progress), target, pipe.mesh.device, None)
    return target.final


class Checkpointer:
    """Saves checkpoints of one pipeline into one directory, synchronously or in the background.

    With ``asynchronous``, :meth:`save` stages the state in host memory (DCP's
    ``async_save``) and returns; a thread of its own writes it, seals the
    manifest and renames the folder, over a gloo group of its own (so it never
    interleaves with the training's collectives). At most one save is in
    flight: the next :meth:`save`, and :meth:`wait`, wait for it, and raise its
    failure there. Every rank makes one, in the same order (the group is
    made collectively), and calls :meth:`close` at the end.
    """

    def __init__(self, directory: str | Path, pipe: Pipeline, *, keep: int = 2, asynchronous: bool = False) -> None:
        self.root = Path(directory)
        self.pipe = pipe
        self.keep = keep
        self.asynchronous = asynchronous
        self._group: dist.ProcessGroup | None = None
        self._device = pipe.mesh.device
        if asynchronous and dist.is_initialized():
            self._group = dist.new_group(backend="gloo", timeout=timedelta(seconds=pipe.mesh.timeout))
            self._device = torch.device("cpu")
        self._thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="stagewise-checkpoint")
        self._pending: concurrent.futures.Future[Path] | None = None

    def save(self, optimizer: torch.optim.Optimizer | None, progress: record.Progress) -> Path:
        """Save this step; returns the checkpoint's folder (complete once :meth:`wait` returns, when asynchronous)."""
        if not self.asynchronous:
            return save(self.root, self.pipe, optimizer, progress, keep=self.keep)
        self.wait()
        target = _Target(self.root, progress.step, self.keep)
        _begin(target, self._device, self._group)
        state = state_of(self.pipe, optimizer, progress)
        try:
            writing = dcp_async_save(
                state, storage_writer=FileSystemWriter(target.partial), process_group=self._group
            )  # staged in host memory before it returns
        except (Exception, CheckpointException) as err:
            _failed(target, reason(err), self._device, self._group)
            raise
        self._pending = self._thread.submit(self._complete, writing, target)
        return target.final

    def _complete(self, writing: Any, target: _Target) -> Path:
        try:
            (writing.upload_completion if hasattr(writing, "upload_completion") else writing).result()
        except (Exception, CheckpointException) as err:
            _failed(target, reason(err), self._device, self._group)
        _finish(target, self._device, self._group)
        return target.final

    @property
    def in_flight(self) -> concurrent.futures.Future[Path] | None:
        """The background save not yet waited for (done or not), whose result is its folder; None when none is."""
        return self._pending

    def wait(self) -> Path | None:
        """Wait for the save in flight, if any: its folder, complete; its failure raised here."""
        pending, self._pending = self._pending, None
        return pending.result() if pending is not None else None

    def close(self) -> None:
        """Wait for the save in flight and end the thread (the group stays: torch destroys it with the others)."""
        try:
            self.wait()
        finally:
            self._thread.shutdown(wait=True)
