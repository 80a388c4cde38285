"""The local launcher: results by rank under both start methods, the failing rank's traceback, modules, two nodes."""

from __future__ import annotations

import json
import os
import signal
import sys
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from support.multiproc import finish, run_ranks, start_ranks
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from stagewise.comm import LaunchError, Layout, launch
from stagewise.comm.cpu_pinning import cpu_shares
from stagewise.comm.launch_failures import failures_of, stderr_tail
from stagewise.comm.launch_options import StartMethod
from stagewise.comm.launcher import free_port, launch_module


def report_rank() -> tuple[int, int, str, str, int, str | None]:
    dist.init_process_group("gloo")
    total = torch.tensor([dist.get_rank()])
    dist.all_reduce(total)
    env = os.environ
    info = (dist.get_rank(), int(total), env["CUDA_VISIBLE_DEVICES"], env["OMP_NUM_THREADS"], torch.get_num_threads())
    dist.destroy_process_group()
    return (*info, env.get("STAGEWISE_TEST_VALUE"))


def fail_on_rank_one() -> None:
    dist.init_process_group("gloo")
    if dist.get_rank() == 1:
        raise ValueError("rank one cannot go on")
    dist.barrier()  # rank 0 waits here until the agent stops it


def leave_on_rank_one(how: str) -> None:
    dist.init_process_group("gloo")
    if dist.get_rank() == 1:
        if how == "interrupt":
            signal.raise_signal(signal.SIGINT)  # to this thread: os.kill may reach one of gloo's, and be seen late
        sys.exit(3)
    dist.barrier()


@pytest.mark.parametrize(
    ("how", "message"),
    [
        ("interrupt", "RuntimeError: interrupted (KeyboardInterrupt, or SIGINT)"),
        ("exit", "RuntimeError: called sys.exit(3) instead of returning; return a value or raise an exception"),
    ],
)
def test_a_rank_that_is_interrupted_or_exits_fails_the_launch_not_hangs_it(how: str, message: str) -> None:
    with pytest.raises(LaunchError) as info:
        run_ranks(leave_on_rank_one, 2, how, timeout=60)
    first = info.value.failures[0]
    assert first.rank == 1 and first.message == message


@pytest.mark.parametrize("start_method", ["spawn", "forkserver", "fork"])
def test_results_come_back_by_rank(start_method: StartMethod) -> None:
    # The runner's fork server imported torch with one thread and without the variable: both must still arrive.
    env = {"STAGEWISE_TEST_VALUE": "seen"}
    results = run_ranks(report_rank, 3, start_method=start_method, threads=2, env=env)
    assert results == {rank: (rank, 3, "", "2", 2, "seen") for rank in range(3)}


def report_cpus() -> list[frozenset[int]]:
    """The CPUs of every thread of this rank, gloo's included, once its group is up."""
    dist.init_process_group("gloo")
    threads = [frozenset(os.sched_getaffinity(int(task))) for task in os.listdir("/proc/self/task")]
    dist.destroy_process_group()
    return threads


def test_pinned_ranks_keep_every_thread_on_cpus_of_their_own() -> None:
    # A fork server's child inherits the server's threads, which a spawned interpreter has not yet started: the
    # harder case. Both start methods pin through the same wrapper (LaunchedFunction), run before fn.
    start_method: StartMethod = "forkserver"
    want = cpu_shares(2)  # what the launcher works out from the same CPUs (the runner inherits ours)
    assert not want[0] & want[1] and want[0] and want[1]
    results = run_ranks(report_cpus, 2, start_method=start_method, pin_cores=True)
    for rank in (0, 1):
        assert len(results[rank]) > 1 and set(results[rank]) == {want[rank]}, results  # main thread and gloo's
    unpinned = run_ranks(report_cpus, 2, start_method=start_method)
    assert {cpus for rank in (0, 1) for cpus in unpinned[rank]} == {frozenset(os.sched_getaffinity(0))}


def test_pinning_needs_a_cpu_per_process_and_a_function() -> None:
    too_many = len(os.sched_getaffinity(0)) + 1
    with pytest.raises(ValueError, match=rf"pin_cores gives each process at least one CPU, but {too_many} processes"):
        launch(report_cpus, too_many, pin_cores=True)
    with pytest.raises(ValueError, match=r"pin_cores applies to launch\(fn\) only"):
        launch_module("json.tool", [], 2, pin_cores=True)


def rank_one_is_killed() -> None:
    dist.init_process_group("gloo")
    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()  # rank 0 fails here as soon as rank 1 is gone


@pytest.mark.parametrize("start_method", ["spawn", "forkserver", "fork"])
def test_a_killed_rank_is_named_first_and_the_peer_that_failed_on_it_after(start_method: StartMethod) -> None:
    # Rank 0 fails within milliseconds of rank 1's death; it lingers so that the agent notices rank 1 first. If it
    # has raised by the time the agent stops it, it is listed after rank 1, without an exit code.
    with pytest.raises(LaunchError) as info:
        run_ranks(rank_one_is_killed, 2, start_method=start_method)
    first, *then = [(f.rank, f.exitcode) for f in info.value.failures]
    assert first == (1, -signal.SIGKILL) and then in ([], [(0, None)]), info.value.failures
    assert str(info.value).startswith("rank 1 failed (exit code -9): Signal 9 (SIGKILL) received by PID")


def test_a_failing_rank_surfaces_its_traceback() -> None:
    with pytest.raises(LaunchError) as info:
        run_ranks(fail_on_rank_one, 2)
    first = info.value.failures[0]
    assert first.rank == 1 and first.exitcode != 0
    assert first.message == "ValueError: rank one cannot go on"
    assert "in fail_on_rank_one" in first.traceback and 'raise ValueError("rank one cannot go on")' in first.traceback
    assert str(info.value).startswith("rank 1 failed (exit code 1): ValueError: rank one cannot go on")


def _error_file(folder: Path, message: str, written_at: float) -> Path:
    folder.mkdir(parents=True)
    path = folder / "error.json"
    trace = f"Traceback (most recent call last):\n{message}"
    data = {"message": {"message": message, "extraInfo": {"py_callstack": trace, "timestamp": str(int(written_at))}}}
    path.write_text(json.dumps(data))
    os.utime(path, (written_at, written_at))
    return path


def test_the_rank_that_raised_first_is_named_first_even_when_the_agent_noticed_another(tmp_path: Path) -> None:
    # Rank 1 raised; rank 0 failed 0.2 s later on the closed connection, in the same second, and the agent noticed
    # only rank 0. Each of the two ranks on this node (global ranks 2 and 3 of the job) left its error file.
    attempt, now = tmp_path / "job_x1" / "attempt_0", 1_700_000_000.1
    _error_file(attempt / "1", "ValueError: rank one cannot go on", now)
    noticed = _error_file(attempt / "0", "RuntimeError: Connection closed by peer", now + 0.2)
    err = ChildFailedError("job", {2: ProcessFailure(local_rank=0, pid=10, exitcode=1, error_file=str(noticed))})
    failures = failures_of(err, tmp_path, Layout(4, 1))
    assert [(f.rank, f.exitcode, f.message, f.where) for f in failures] == [
        (3, None, "ValueError: rank one cannot go on", "stage 3, replica 0"),  # stopped by the agent: no exit code
        (2, 1, "RuntimeError: Connection closed by peer", "stage 2, replica 0"),
    ]
    assert str(LaunchError(failures)).startswith("rank 3 (stage 3, replica 0) failed: ValueError: rank one cannot")


def test_a_killed_rank_the_agent_noticed_comes_with_the_ranks_that_raised_after_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A killed rank leaves no error file; the agent dates its failure when it noticed it, in whole seconds, so its
    # peer's report can look earlier (a kill just before a second begins, noticed just after).
    killed = ProcessFailure(local_rank=1, pid=10, exitcode=-9, error_file=str(tmp_path / "none.json"))
    _error_file(tmp_path / "job_x1" / "attempt_0" / "0", "PeerGoneError: rank 0 lost rank 1", killed.timestamp - 3)
    _error_file(tmp_path / "job_x1" / "attempt_1" / "0", "PeerGoneError: rank 0 lost rank 1", killed.timestamp - 0.05)
    monkeypatch.chdir(tmp_path)
    _error_file(tmp_path / "elsewhere", "RuntimeError: not this job's", killed.timestamp)  # in the working folder
    failures = failures_of(ChildFailedError("job", {1: killed}), tmp_path)
    assert [(f.rank, f.exitcode, f.message) for f in failures] == [
        (1, -9, "Signal 9 (SIGKILL) received by PID 10"),
        (0, None, "PeerGoneError: rank 0 lost rank 1"),  # once: from the last attempt only
    ]


def return_a_graph() -> torch.Tensor:
    return torch.ones(2, requires_grad=True) * 2  # attached to autograd: cannot cross processes


def test_a_result_that_cannot_come_back_is_named() -> None:
    with pytest.raises(LaunchError) as info:
        run_ranks(return_a_graph, 2)
    assert info.value.failures[0].message.startswith(
        "TypeError: return_a_graph returned a value that cannot be sent back to the launcher: RuntimeError: "
        "Cowardly refusing to serialize non-leaf tensor which requires_grad"
    )


def test_a_rank_the_agent_stopped_comes_after_the_rank_that_exited_by_itself(tmp_path: Path) -> None:
    # Rank 1 exited with code 2 (an argument error, no error file); the agent then stopped rank 0 with SIGTERM and
    # recorded both, in the same second.
    missing = str(tmp_path / "none.json")
    stopped = ProcessFailure(local_rank=0, pid=10, exitcode=-signal.SIGTERM, error_file=missing)
    exited = ProcessFailure(local_rank=1, pid=11, exitcode=2, error_file=missing)
    failures = failures_of(ChildFailedError("job", {0: stopped, 1: exited}), tmp_path)
    assert [(f.rank, f.exitcode) for f in failures] == [(1, 2), (0, -signal.SIGTERM)]


def test_launch_module_reports_the_failing_rank(tmp_path: Path) -> None:
    with pytest.raises(LaunchError) as info:
        launch_module("stagewise", ["partition", "--stages", "0"], 2)
    assert "--stages: expected a number >= 1, got 0" in info.value.failures[0].traceback


def test_bad_launch_arguments() -> None:
    with pytest.raises(ValueError, match=r"^nprocs must be >= 1, got 0; launch at least one process$"):
        launch(report_rank, 0)
    with pytest.raises(ValueError, match=r"nnodes=2 needs rdzv_endpoint='HOST:PORT'"):
        launch(report_rank, 1, nnodes=2)
    with pytest.raises(
        ValueError, match=r"^threads must be >= 1, got 0; give at least 1, or None to leave OMP_NUM_THREADS alone$"
    ):
        launch(report_rank, 1, threads=0)
    with pytest.raises(ValueError, match=r"device must be 'cpu' or 'auto'"):
        launch(report_rank, 1, device="tpu")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"start_method must be one of \['spawn', 'forkserver', 'fork'\], got 'vfork'"):
        launch(report_rank, 1, start_method="vfork")  # type: ignore[typeddict-item]
    with pytest.raises(ValueError, match=r"launch_module starts fresh interpreters; start_method='forkserver'"):
        launch_module("stagewise", ["partition"], 1, start_method="forkserver")
    # A misspelt option, or the function's own keyword, was dropped without a word.
    with pytest.raises(TypeError, match=r"launch got options it does not have: lr, thread; it takes device, env, "):
        launch(report_rank, 1, thread=4, lr=0.1)  # type: ignore[call-arg]


def test_a_failure_report_quotes_the_latest_attempt(tmp_path: Path) -> None:
    for attempt in (2, 9, 10):
        folder = tmp_path / "run" / f"attempt_{attempt}" / "0"
        folder.mkdir(parents=True)
        (folder / "stderr.log").write_text(f"attempt {attempt}\n")
    assert stderr_tail(tmp_path, 0) == "attempt 10"


def test_two_local_nodes_form_one_job() -> None:
    endpoint = f"127.0.0.1:{free_port()}"
    with tempfile.TemporaryDirectory() as a, tempfile.TemporaryDirectory() as b:
        host = start_ranks(report_rank, 2, workdir=Path(a), nnodes=2, rdzv_endpoint=endpoint, is_host=True)
        other = start_ranks(report_rank, 2, workdir=Path(b), nnodes=2, rdzv_endpoint=endpoint, is_host=False)
        first, second = finish(host, Path(a), 120), finish(other, Path(b), 120)
    ranks = sorted([*first, *second])
    assert ranks == [0, 1, 2, 3]
    # Every rank saw the same all-reduce over four processes: 0 + 1 + 2 + 3.
    assert {v[1:] for v in [*first.values(), *second.values()]} == {(6, "", "1", 1, None)}
