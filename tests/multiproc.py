"""The one helper that runs a test function on several gloo processes, with a hard timeout.

``run_ranks(fn, nprocs, *args, timeout=60)`` launches ``fn(*args)`` on
``nprocs`` local processes through :func:`stagewise.comm.launch` (torchrun's
elastic agent), inside a runner process in its own session. If the job has not
finished within ``timeout`` seconds, the whole session (runner, agent and
workers) is killed and the test fails; a hang never stalls the suite.
Results come back as a dict from global rank to ``fn``'s return value; a
failed rank raises :class:`stagewise.comm.LaunchError` here.
"""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest


def _command(fn: Callable[..., Any], nprocs: int, args: Sequence[Any], options: dict[str, Any], workdir: Path) -> Path:
    job = workdir / "job.pkl"
    job.write_bytes(pickle.dumps((fn.__module__, fn.__qualname__, nprocs, tuple(args), options)))
    return job


def start_ranks(
    fn: Callable[..., Any], nprocs: int, *args: Any, workdir: Path, **options: Any
) -> subprocess.Popen[bytes]:
    """Start the runner for one launch in its own session; see :func:`finish`."""
    job = _command(fn, nprocs, args, options, workdir)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    return subprocess.Popen(
        [sys.executable, __file__, str(job)],
        env=env,
        start_new_session=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )


def finish(runner: subprocess.Popen[bytes], workdir: Path, timeout: float) -> dict[int, Any]:
    """Wait for a runner; kill its whole session and fail the test when it outlives ``timeout``."""
    try:
        output, _ = runner.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(runner.pid, signal.SIGKILL)
        output, _ = runner.communicate()
        tail = output.decode(errors="replace")[-3000:]
        pytest.fail(f"distributed test did not finish within {timeout:g} s; killed it. Output tail:\n{tail}")
    result = workdir / "job.pkl.out"
    if not result.exists():
        tail = output.decode(errors="replace")[-3000:]
        pytest.fail(f"the runner exited with {runner.returncode} and no result. Output tail:\n{tail}")
    ok, value = pickle.loads(result.read_bytes())
    if not ok:
        raise value
    return dict(value)


def run_ranks(fn: Callable[..., Any], nprocs: int, *args: Any, timeout: float = 90, **options: Any) -> dict[int, Any]:
    """Run ``fn(*args)`` on ``nprocs`` gloo processes; ``options`` go to :func:`stagewise.comm.launch`."""
    with tempfile.TemporaryDirectory(prefix="stagewise-test-") as tmp:
        runner = start_ranks(fn, nprocs, *args, workdir=Path(tmp), **options)
        return finish(runner, Path(tmp), timeout)


def _main(job: Path) -> None:
    import importlib

    from stagewise.comm import LaunchError, launch

    module, qualname, nprocs, args, options = pickle.loads(job.read_bytes())
    fn = importlib.import_module(module)
    for part in qualname.split("."):
        fn = getattr(fn, part)
    start = time.perf_counter()
    try:
        outcome: tuple[bool, Any] = (True, launch(fn, nprocs, *args, **options))
    except LaunchError as err:
        outcome = (False, err)
    Path(f"{job}.out").write_bytes(pickle.dumps(outcome))
    print(f"runner: {qualname} on {nprocs} processes took {time.perf_counter() - start:.1f} s", flush=True)


if __name__ == "__main__":
    _main(Path(sys.argv[1]))
