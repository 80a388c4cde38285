"""The fault matrix on 4 gloo processes: a rank killed in each phase under pp2 x dp2, pp2 x fsdp2 and pp2 x tp2,
rank 0 killed in the middle of a save, a rank stopped inside a collective, and the launcher killed alone.

Each row ends the job within the timeout (plus the time to notice), names the rank, and leaves the latest
complete checkpoint intact: the steps lost are those since it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import tempfile
import time
from pathlib import Path

import pytest
import torch
from support.faults import arm
from support.multiproc import run_ranks, start_ranks

from stagewise import checkpoint
from stagewise.checkpoint import folders
from stagewise.comm import LaunchError, Layout
from stagewise.pipeline import Pipeline
from stagewise.run import TrainConfig, train

TIMEOUT = 12.0
"""Every rank's bound on a wait (``train --timeout``) where a stopped peer is to be noticed after it: long enough
for a step of 4 processes on 2 busy cores, short enough for the suite."""
KILL_TIMEOUT = 30.0
"""The bound where a rank is killed: its peers learn of it at once, from the agent, not by a timeout."""
BASE = TrainConfig(
    model="gpt-tiny", pp=2, microbatches=2, batch_size=8, seq_len=32, steps=6, warmup=1, eval_every=0,
    checkpoint_every=2, timeout=KILL_TIMEOUT,
)  # fmt: skip
LAYOUTS = {"pp2 x dp2": Layout(2, 2), "pp2 x fsdp2": Layout(2, 1, 2), "pp2 x tp2": Layout(2, 1, 1, 2)}
VICTIM = 3
"""The rank that dies (stage 1, the last of the layout's ranks), unless a row says rank 0."""


def _config(layout: Layout, root: str, how: signal.Signals) -> TrainConfig:
    timeout = TIMEOUT if how == signal.SIGSTOP else KILL_TIMEOUT
    return dataclasses.replace(BASE, dp=layout.dp, fsdp=layout.fsdp, tp=layout.tp, checkpoint_dir=root, timeout=timeout)


def _mark(root: str) -> None:
    """Record when the fault happened, for the test to time the job's end from."""
    Path(f"{root}.fault").write_text(json.dumps({"at": time.time(), "pid": os.getpid()}))


def _fault(root: str, how: signal.Signals) -> None:
    _mark(root)
    os.kill(os.getpid(), how)


def faulty(layout: Layout, phase: str, victim: int, how: signal.Signals, root: str) -> None:
    torch.set_num_threads(1)

    def armed(pipe: Pipeline) -> None:
        if int(os.environ["RANK"]) == victim:  # in step 4: the save of step 2 is the latest complete checkpoint
            arm(pipe, phase, 4, BASE.microbatches, lambda: _fault(root, how))

    train(_config(layout, root, how), on_start=armed)


def _ended(root: Path, layout: Layout, phase: str, victim: int, how: signal.Signals) -> tuple[LaunchError, float]:
    """Run the faulty job; its error, and the seconds from the fault to the job's end."""
    with pytest.raises(LaunchError) as info:
        run_ranks(faulty, 4, layout, phase, victim, how, str(root), timeout=150, layout=layout)
    ended = time.time()
    marked = Path(f"{root}.fault")
    assert marked.exists(), f"the job failed before its fault: {info.value}"
    fault = json.loads(marked.read_text())
    return info.value, ended - fault["at"]


def _intact_at_step_2(root: Path) -> None:
    """The save of step 4 never completed: step 2's checkpoint is the latest, and every byte of it verifies."""
    assert [p.name for p in folders.complete(root)] == ["step-00000002"]
    assert checkpoint.choose(root, checksums=True).path == root / "step-00000002"


@pytest.mark.parametrize("phase", ["forward", "backward", "optimizer", "save"])
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_a_rank_killed_in_any_phase_of_any_layout_ends_the_job_named(name: str, phase: str, tmp_path: Path) -> None:
    layout = LAYOUTS[name]
    error, seconds = _ended(tmp_path / "ckpt", layout, phase, VICTIM, signal.SIGKILL)
    dead = [f for f in error.failures if f.rank == VICTIM]
    assert dead and dead[0].exitcode == -signal.SIGKILL, error.failures
    assert error.headline.startswith(f"rank {VICTIM} (stage 1, "), error.headline
    assert "failed (exit code -9)" in error.headline
    assert seconds < 10, seconds  # the agent notices a dead rank within its monitor interval
    _intact_at_step_2(tmp_path / "ckpt")


def test_rank_0_killed_in_the_middle_of_a_save_leaves_the_previous_checkpoint_the_latest(tmp_path: Path) -> None:
    error, seconds = _ended(tmp_path / "ckpt", LAYOUTS["pp2 x fsdp2"], "seal", 0, signal.SIGKILL)
    assert error.headline.startswith("rank 0 (stage 0, ") and "failed (exit code -9)" in error.headline
    assert seconds < 10, seconds  # the agent notices a dead rank within its monitor interval
    _intact_at_step_2(tmp_path / "ckpt")
    assert (tmp_path / "ckpt" / "step-00000004.partial").is_dir()  # every rank's part, never renamed: ignored


@pytest.mark.parametrize(
    ("name", "phase"),
    [("pp2 x dp2", "backward"), ("pp2 x fsdp2", "optimizer"), ("pp2 x tp2", "forward"), ("pp2 x fsdp2", "save")],
)
def test_a_rank_stopped_inside_a_collective_ends_the_job_naming_it(name: str, phase: str, tmp_path: Path) -> None:
    # DDP's all-reduce of the gradients waits in the backward, FSDP's reduce-scatter after it and its
    # all-gather before the next forward, tensor parallelism's all-reduces inside the forward, DCP's gathers in
    # the save: the stopped rank never joins, the others time out and say which rank is stopped.
    error, seconds = _ended(tmp_path / "ckpt", LAYOUTS[name], phase, VICTIM, signal.SIGSTOP)
    # The first failure is a peer's timeout (stagewise's own, or gloo's inside torch's collectives), naming it.
    assert error.headline.endswith(f"; rank {VICTIM} is stopped (SIGSTOP, Ctrl-Z or a debugger), so it never answered")
    assert error.failures[0].rank != VICTIM, error.headline
    assert seconds < TIMEOUT + 10, seconds


def endless(root: str) -> None:
    """Train for far longer than the test waits, recording this rank's pid."""
    torch.set_num_threads(1)
    Path(f"{root}.{os.environ['RANK']}.pid").write_text(str(os.getpid()))
    train(dataclasses.replace(BASE, dp=2, steps=100_000, checkpoint_every=0, checkpoint_dir=None, timeout=TIMEOUT))


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_the_launcher_killed_alone_takes_every_rank_and_its_shared_memory_with_it(tmp_path: Path) -> None:
    root = tmp_path / "job"
    with tempfile.TemporaryDirectory() as work:
        runner = start_ranks(endless, 4, str(root), workdir=Path(work), layout=LAYOUTS["pp2 x dp2"])
        deadline = time.monotonic() + 120
        pids: list[int] = []
        while len(pids) < 4 and time.monotonic() < deadline:
            time.sleep(0.2)
            pids = [int(p.read_text()) for p in tmp_path.glob("job.*.pid") if p.read_text()]
        assert len(pids) == 4, "the ranks did not start"
        time.sleep(3)  # training: the shared-memory wires are connected
        assert runner.alive(), runner.tail()
        os.kill(runner.pid, signal.SIGKILL)  # the launcher alone, not its session, with transfers in flight
        killed = time.monotonic()
        while any(_alive(pid) for pid in pids) and time.monotonic() - killed < TIMEOUT:
            time.sleep(0.1)
        gone_after = time.monotonic() - killed
        # Each segment is named after the rank that made it (stagewise-NS-PID-START-...).
        left = [p for p in Path("/dev/shm").glob("stagewise-*") if any(f"-{pid}-" in p.name for pid in pids)]
    assert not [pid for pid in pids if _alive(pid)], f"ranks still running {gone_after:.1f} s after the launcher died"
    assert left == [], left
