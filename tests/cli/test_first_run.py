"""The main job as a newcomer meets it: a folder per run, resume of the latest, and Ctrl-C or SIGTERM mid-run."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from support.training import BASE, Runs

from stagewise.cli import main
from stagewise.run.runs import latest_run, new_run

FAST = ["--steps", "60", "--batch-size", "4", "--microbatches", "2", "--seq-len", "16", "--eval-every", "0"]
FAST += ["--eval-batches", "1", "--data-limit", "256KiB", "--warmup", "2"]


def test_each_run_gets_a_folder_of_its_own_and_latest_names_the_newest(tmp_path: Path) -> None:
    first, second = new_run(tmp_path), new_run(tmp_path)  # the same second: the second one is numbered
    assert first != second and first.is_dir() and second.is_dir()
    assert latest_run(tmp_path) == second.resolve()
    assert latest_run(tmp_path / "nothing-here") is None


def test_a_resume_of_a_finished_run_is_refused_before_any_process_starts(
    runs: Runs, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--resume"]) == 2  # no run yet to resume
    assert "--resume continues the latest run in stagewise-run/, but there is none there" in capsys.readouterr().err
    # The reference run's checkpoint at step 4, as the latest run's: a resume to step 4 has nothing left to do.
    folder = new_run(tmp_path / "stagewise-run")
    shutil.copytree(runs.root / "half" / "step-00000004", folder / "checkpoints" / "step-00000004")
    argv = ["train", "--model", BASE.model, "--batch-size", str(BASE.batch_size), "--seq-len", str(BASE.seq_len)]
    argv += ["--microbatches", str(BASE.microbatches), "--steps", "4", "--resume"]
    began = time.monotonic()
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err  # one line
    assert err.endswith(
        "is at step 4, at or past this run's last step (4): there is nothing left to train; give a later "
        "--stop-after or more --steps\n"
    )
    assert time.monotonic() - began < 20  # no process was started (a launch alone takes longer here)


def _signal_after(process: subprocess.Popen[str], step: int, sig: signal.Signals, group: bool) -> list[str]:
    """Read the run's output (a line per step: ``--log-every 1``); once it shows ``step`` steps done, send ``sig``
    to the run (or, as a terminal's Ctrl-C does, to its whole process group). Returns the lines read."""
    assert process.stdout is not None
    seen: list[str] = []
    sent = False
    for line in process.stdout:
        seen.append(line)
        done = re.match(r"step (\d+)/60: ", line)
        if not sent and done and int(done[1]) >= step:
            if group:
                os.killpg(process.pid, sig)
            else:
                process.send_signal(sig)
            sent = True
    return seen


def _train(cwd: Path, *extra: str, stop: tuple[int, signal.Signals, bool] | None = None) -> tuple[int, str, str]:
    """``python -m stagewise train`` in ``cwd`` (exit status, stdout, stderr), stopped by a signal when asked."""
    steps = ["--log-every", "1"] if stop else []
    process = subprocess.Popen(
        [sys.executable, "-m", "stagewise", "train", *FAST, *steps, *extra], cwd=cwd, text=True,
        start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    out: list[str] = []
    reader = threading.Thread(
        target=lambda: out.extend(_signal_after(process, *stop) if stop else [process.stdout.read()])  # type: ignore[union-attr]
    )
    reader.start()
    try:
        err = process.stderr.read()  # type: ignore[union-attr]
        process.wait(timeout=120)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
        reader.join()
    return process.returncode, "".join(out), err


@pytest.mark.timeout(300)
def test_sigterm_and_ctrl_c_stop_at_a_step_with_a_checkpoint_and_resume_continues_exactly(tmp_path: Path) -> None:
    code, out, err = _train(tmp_path, stop=(5, signal.SIGTERM, False))  # a cluster's preemption: the run alone
    assert code == 0, err[-2000:]
    stopped = re.search(r"stopped by SIGTERM after step (\d+) of 60; checkpoint (\S+); continue with: (.*)\n", out)
    assert stopped is not None, out
    first = int(stopped[1])
    assert 5 <= first < 60 and stopped[2].endswith(f"step-{first:08d}")
    assert stopped[3] == "python -m stagewise train --resume"
    assert "Traceback" not in err
    code, out, err = _train(tmp_path, "--resume", stop=(first + 5, signal.SIGINT, True))  # Ctrl-C in a terminal
    assert code == 130, err[-2000:]
    assert f"resumed from step {first}" in out
    interrupted = re.search(r"stopped by SIGINT after step (\d+) of 60; checkpoint (\S+); continue with", out)
    assert interrupted is not None, out
    second = int(interrupted[1])
    assert first < second < 60 and "Traceback" not in err
    code, out, err = _train(tmp_path)  # a second fresh run in the same place, uninterrupted: the reference
    assert code == 0, err[-2000:]
    runs = sorted(p for p in (tmp_path / "stagewise-run").iterdir() if p.name != "latest")
    assert len(runs) == 2 and latest_run(tmp_path / "stagewise-run") == runs[1].resolve()
    stopped_run = json.loads((runs[0] / "summary.json").read_text())
    reference = json.loads((runs[1] / "summary.json").read_text())
    # Stopped twice and resumed, the run's losses are the uninterrupted run's, bit for bit.
    assert stopped_run["first_step"] == 0 and len(stopped_run["losses"]) == second
    assert stopped_run["losses"] == reference["losses"][:second]
    assert (runs[0] / "loss.png").stat().st_size > 0


@pytest.mark.timeout(200)
def test_a_failure_in_a_rank_is_one_line_with_the_log_that_holds_the_rest(tmp_path: Path) -> None:
    # The traceback of every rank, and torch's agent's own report of it, reached the terminal: 40 lines.
    code, _, err = _train(tmp_path, "--lr", "1e9")  # AdamW at that rate makes the loss NaN within steps
    assert code == 1
    lines = [line for line in err.replace("\r", "\n").splitlines() if line and not line.startswith("train:")]
    assert len(lines) == 1, lines
    failed = re.fullmatch(
        r"stagewise train: rank \d \(stage \d, replica 0\) failed(?: \(exit code \d+\))?: NonFiniteLossError: "
        r"the loss is (?:nan|inf) at step \d+ .*\(the full report: (\S+)\)",
        lines[0],
    )
    assert failed is not None, lines[0]
    log = (tmp_path / failed[1]).read_text()
    assert "Traceback (most recent call last)" in log and "NonFiniteLossError" in log
