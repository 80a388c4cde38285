"""Checkpoints you can trust: reading one never runs code, its manifest catches a changed or missing file, a failed
save loses nothing, one run writes a folder, and the background save writes what the synchronous one does."""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess
from functools import partial
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from support.multiproc import run_ranks
from support.training import BASE, Runs, exported, launch_run
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from stagewise import checkpoint
from stagewise.checkpoint import folders
from stagewise.checkpoint.safe_reader import SafeReader, TensorsOnly, read_tensors
from stagewise.cli import main
from stagewise.comm import LaunchError
from stagewise.run import build_pipeline


def _short_text(value: str) -> bytes:
    raw = value.encode()
    return b"\x8c" + bytes([len(raw)]) + raw  # SHORT_BINUNICODE


def dotted_global(module: str, name: str, argument: str) -> bytes:
    """A protocol-4 pickle that calls ``module``'s ``name`` (a dotted path, which STACK_GLOBAL follows) with
    ``argument``: what plain pickle would run."""
    return b"\x80\x04" + _short_text(module) + _short_text(name) + b"\x93" + _short_text(argument) + b"\x85R."


def test_an_index_naming_a_dotted_global_inside_an_allowed_module_runs_nothing(tmp_path: Path) -> None:
    # The old allow-list admitted any name inside torch.distributed.checkpoint.filesystem, and pickle follows
    # "os.system" from there to os: `id` ran before the index was refused.
    marker = tmp_path / "ran"
    folder = tmp_path / "step-00000001"
    folder.mkdir()
    (folder / ".metadata").write_bytes(
        dotted_global("torch.distributed.checkpoint.filesystem", "os.system", f"mkdir {marker}")
    )
    refused = "torch.distributed.checkpoint.filesystem.os.system is not allowed in a checkpoint's metadata"
    for read in (
        lambda: SafeReader(folder).read_metadata(),
        lambda: checkpoint.progress_of(folder),  # what train --resume's launcher reads before any rank starts
        lambda: checkpoint.export(folder, tmp_path / "out.pt"),
    ):
        with pytest.raises(checkpoint.CheckpointError, match=refused):
            read()
    assert not marker.exists()


class _Planted:
    """An object DCP stores as pickled bytes; loading it makes a folder: proof that the loader ran code."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.mkdir, (self.path,))


def _with_bytes_entry(saved: Path, into: Path, key: str, marker: str) -> None:
    """A copy of the checkpoint ``saved`` whose entry ``key`` DCP stores as pickled bytes (``_Planted``)."""
    reader = SafeReader(saved)
    stored = reader.read_metadata().state_dict_metadata
    state: dict[str, object] = {k: torch.empty(v.size, dtype=v.properties.dtype) for k, v in stored.items()}
    read_tensors(state, reader, stored, alone=True)
    state[key] = _Planted(marker)
    dcp_save(state, storage_writer=FileSystemWriter(into), no_dist=True)


def bytes_entries(root: str) -> dict[str, str]:
    """Save a checkpoint, plant a pickled entry under a model key and under the progress record; what each
    reader said, and whether the planted code ran."""
    torch.set_num_threads(1)
    base = Path(root)
    config = dataclasses.replace(BASE, pp=1, checkpoint_dir=str(base / "good"))
    pipe = build_pipeline(config)
    saved = checkpoint.save(base / "good", pipe, None, checkpoint.Progress(1, 0, 0))
    model_key = "model/" + next(k for k in pipe.state_dict() if k.startswith("blocks."))  # not a tied one
    out: dict[str, str] = {}
    for case, key in (("model", model_key), ("progress", "progress")):
        copy, marker = base / case / "step-00000001", str(base / f"ran-{case}")
        _with_bytes_entry(saved, copy, key, marker)
        readers = {
            "load": partial(checkpoint.load, copy, pipe),
            "progress_of": partial(checkpoint.progress_of, copy),
            "export": partial(checkpoint.export, copy, base / "out.pt"),
        }
        for reader, action in readers.items():
            try:
                action()
                out[f"{case} {reader}"] = "accepted"
            except checkpoint.CheckpointError as err:
                out[f"{case} {reader}"] = str(err)
        # The planner alone refuses the bytes, whatever asked for them.
        try:
            from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

            dcp_load({key: torch.empty(1)}, storage_reader=SafeReader(copy), planner=TensorsOnly(), no_dist=True)
            out[f"{case} planner"] = "accepted"
        except BaseException as err:  # DCP wraps it in a CheckpointException, a BaseException
            out[f"{case} planner"] = str(err)
        out[f"{case} ran"] = str(Path(marker).exists())
    dist.destroy_process_group()
    return out


def test_an_entry_stored_as_pickled_bytes_is_refused_before_it_is_read() -> None:
    # DCP reads a bytes entry with torch.load(weights_only=False): on every rank, before any check, it ran code.
    import tempfile

    with tempfile.TemporaryDirectory() as root:
        out = run_ranks(bytes_entries, 1, root, timeout=120)[0]
    assert out["model progress_of"] == "accepted"  # it reads the progress record alone
    for case in ("model", "progress"):
        assert out[f"{case} ran"] == "False", out
        for reader in ("load", "export") if case == "model" else ("load", "progress_of"):
            assert "is a BytesStorageMetadata, not a tensor" in out[f"{case} {reader}"], (case, reader, out)
        assert "stored as pickled bytes, which stagewise never loads" in out[f"{case} planner"], out


def _flip_a_byte(folder: Path) -> Path:
    data = max(folder.glob("__*.distcp"), key=lambda p: p.stat().st_size)
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    data.write_bytes(bytes(raw))
    return data


def test_the_manifest_finds_a_changed_or_missing_file_and_the_one_before_is_chosen(runs: Runs, tmp_path: Path) -> None:
    whole = runs.root / "whole"
    for case in ("flipped", "missing"):
        shutil.copytree(whole, tmp_path / case, ignore=shutil.ignore_patterns(".lock"))
    flipped = _flip_a_byte(tmp_path / "flipped" / "step-00000008")
    missing = next((tmp_path / "missing" / "step-00000008").glob("__1_*.distcp"))
    missing.unlink()
    assert checkpoint.verify(whole / "step-00000008", checksums=True) is None
    # A flipped byte keeps the size: the checksum finds it.
    assert checkpoint.verify(flipped.parent, checksums=False) is None
    changed = checkpoint.verify(flipped.parent, checksums=True)
    assert changed is not None and changed.startswith(f"its file {flipped.name} has changed since it was written")
    assert checkpoint.verify(missing.parent, checksums=False) == f"its file {missing.name} is missing"
    for case, checksums in (("flipped", True), ("missing", False)):
        choice = checkpoint.choose(tmp_path / case, checksums=checksums)
        assert choice.path == tmp_path / case / "step-00000004"
        assert [r.path.name for r in choice.refused] == ["step-00000008"]
        assert choice.describe().endswith("; resuming from step-00000004 instead")


def test_a_resume_passes_over_a_broken_newest_checkpoint_for_the_one_before(runs: Runs, tmp_path: Path) -> None:
    shutil.copytree(runs.root / "whole", tmp_path, dirs_exist_ok=True, ignore=shutil.ignore_patterns(".lock"))
    _flip_a_byte(tmp_path / "step-00000008")
    # Rank 0 chose step 4 (step 8 fails its checksum) and every rank loaded it: the next losses continue step 4.
    config = dataclasses.replace(BASE, checkpoint_dir=str(tmp_path), resume=True, steps=8, stop_after=6)
    torch.testing.assert_close(launch_run(config), runs.whole[4:6], atol=0, rtol=0)


def test_a_resume_with_nothing_to_resume_is_refused_before_any_process_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # It warned and trained from step 0.
    assert main(["train", "--resume", "--out", str(tmp_path), "--steps", "2"]) == 2
    err = capsys.readouterr().err
    assert f"resume continues the latest checkpoint in {tmp_path}/checkpoints, but it holds none" in err


def test_one_run_writes_a_checkpoint_directory(tmp_path: Path) -> None:
    held = rf"{tmp_path} is being written by another run \(pid "
    with folders.WriterLock(tmp_path), pytest.raises(checkpoint.CheckpointError, match=held):
        folders.check_unlocked(tmp_path)
    folders.check_unlocked(tmp_path)  # released: free again


def _mount_tmpfs(where: Path, size: str) -> bool:
    where.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], check=False)
    return done.returncode == 0


def test_a_save_onto_a_full_disk_names_the_cause_and_keeps_the_previous_checkpoint(tmp_path: Path) -> None:
    disk = tmp_path / "disk"
    if not _mount_tmpfs(disk, "12m"):  # room for one checkpoint of BASE (about 10.6 MB), not two
        pytest.skip("mounting a small tmpfs needs root (CAP_SYS_ADMIN): the real full disk cannot be made here")
    try:
        config = dataclasses.replace(BASE, checkpoint_dir=str(disk), checkpoint_every=2, stop_after=4)
        with pytest.raises(LaunchError) as info:
            launch_run(config)
        message = str(info.value).splitlines()[0]
        assert "CheckpointError: saving the checkpoint" in message and "step-00000004 failed: " in message, message
        # Where the disk fills decides the writer's words ("No space left on device", or torch's serializer's
        # "unexpected pos"): the room left there says why.
        room = re.search(
            r"\((\d+(?:\.\d+)?) (B|KiB|MiB) free there\); the previous checkpoint stays the latest$", message
        )
        assert room is not None, message
        assert float(room[1]) * {"B": 1, "KiB": 2**10, "MiB": 2**20}[room[2]] < 2**20, message  # a full disk
        assert sorted(p.name for p in disk.iterdir() if p.name.startswith("step-")) == ["step-00000002"]
        assert checkpoint.verify(disk / "step-00000002", checksums=True) is None
    finally:
        subprocess.run(["umount", str(disk)], check=False)


def test_a_background_save_writes_what_the_synchronous_save_writes(runs: Runs, tmp_path: Path) -> None:
    config = dataclasses.replace(
        BASE, checkpoint_dir=str(tmp_path), checkpoint_every=2, stop_after=4, checkpoint_async=True
    )
    torch.testing.assert_close(launch_run(config), runs.whole[:4], atol=0, rtol=0)
    assert [p.name for p in folders.complete(tmp_path)] == ["step-00000002", "step-00000004"]
    assert checkpoint.verify(tmp_path / "step-00000004", checksums=True) is None
    got, want = exported(tmp_path, 4, tmp_path / "a.pt"), exported(runs.root / "half", 4, tmp_path / "s.pt")
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=0, rtol=0, msg=name)
