"""``stagewise nodes``: the torchrun command each node of a several-node train job runs, and what it refuses."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from stagewise.cli import main
from stagewise.run.node_launch import Endpoint, NodeLaunch, endpoint_of

NODES = ["nodes", "--nnodes", "2", "--rdzv-endpoint", "node0:29500", "--rdzv-id", "4242"]


def test_nodes_prints_the_command_each_node_runs(capsys: pytest.CaptureFixture[str]) -> None:
    flags = ["--model", "gpt-1.3b", "--pp", "8", "--dp", "2", "--out", "/shared/my runs/1b"]
    assert main([*NODES, "--max-restarts", "3", "train", *flags]) == 0
    shown = capsys.readouterr()
    assert shlex.split(shown.out) == [
        "torchrun", "--nnodes", "2", "--nproc-per-node", "8", "--rdzv-backend", "c10d",
        "--rdzv-endpoint", "node0:29500", "--rdzv-id", "4242", "--max-restarts", "3",
        "-m", "stagewise", "train", *flags,
    ]  # fmt: skip
    assert "'/shared/my runs/1b'" in shown.out  # quoted for the shell
    assert shown.err == (
        "# each of the 2 nodes runs this (8 processes each, 16 in all); the job's store is node0:29500: keep it on a "
        "trusted network\n"
    )


def test_nodes_says_where_a_run_without_out_writes(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*NODES, "train", "--model", "mlp-tiny", "--pp", "2"]) == 0
    shown = capsys.readouterr()
    assert "--nproc-per-node 1 " in shown.out
    assert "(1 process each, 2 in all)" in shown.err
    assert "# no --out: each node writes stagewise-run/ in its own working folder" in shown.err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--nnodes", "1", "--rdzv-endpoint", "node0:29500", "--rdzv-id", "7", "train"],
            "1 node needs no torchrun: python -m stagewise train starts the processes itself, with its rendezvous on "
            "loopback alone; give 2 nodes or more",
        ),
        (
            [*NODES[1:], "train", "--pp", "3"],
            "the job's 3 processes (--pp 3 x --dp 1) do not split evenly over 2 nodes; choose a number of nodes "
            "that divides 3, or change those flags",
        ),
        (
            [*NODES[1:], "--nproc-per-node", "8", "train", "--pp", "2", "--dp", "2", "--tp", "2"],
            "2 nodes x 8 processes are 16 processes, but the job has 8 (--pp 2 x --dp 2 x --tp 2); change those "
            "flags, or the nodes or processes per node",
        ),
        (
            ["--nnodes", "2", "--rdzv-endpoint", "node0", "--rdzv-id", "7", "train", "--pp", "2"],
            "the rendezvous endpoint 'node0' is not HOST:PORT with a port 1-65535; give the first node's host and a "
            "free port there, e.g. node0:29500",
        ),
        (
            ["--nnodes", "2", "--rdzv-endpoint", "0.0.0.0:29500", "--rdzv-id", "7", "train", "--pp", "2"],
            "the rendezvous endpoint '0.0.0.0:29500' names no host the nodes can reach",
        ),
        (
            ["--nnodes", "2", "--rdzv-endpoint", "node0:29500", "--rdzv-id", "none", "train", "--pp", "2"],
            "the job id 'none' is not one of this job's own; give the scheduler's job id (letters, digits, '.', '_', "
            "'-'), e.g. $SLURM_JOB_ID, a new one for each job",
        ),
        (
            NODES[1:],
            "nodes needs the train command last, not nothing; write: stagewise nodes --nnodes 2 --rdzv-endpoint "
            "HOST:PORT --rdzv-id JOB_ID train --model ... --pp ... --dp ...",
        ),
        (
            [*NODES[1:], "train", "--pp", "2", "--pin-cores"],
            "--pin-cores applies when stagewise starts the processes; torchrun starts them: leave it out",
        ),
        (
            [*NODES[1:], "train", "--pp", "2", "--max-restarts", "2"],
            "train --max-restarts 2 applies when stagewise starts the processes; give it to nodes before the train "
            "command (torchrun's --max-restarts)",
        ),
        (
            [*NODES[1:], "train", "--pp", "2", "--tokenizer", "/models/llama"],
            "the data (the Python standard library's source) must be tokenized before torchrun starts the ranks "
            "(tokenizer /models/llama): run python -m stagewise tokenize --data ... --tokenizer ... --out DIR, with "
            "DIR where every node reads it, then give --data DIR",
        ),
        (
            [*NODES[1:], "--max-restarts", "-1", "train", "--pp", "2"],
            "--max-restarts must be >= 0, got -1",
        ),
    ],
)
def test_nodes_refuses_in_one_line(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["nodes", *argv]) == 2
    shown = capsys.readouterr()
    assert shown.out == ""
    assert shown.err.startswith(f"stagewise nodes: error: {message}") and shown.err.count("\n") == 1, shown.err


def test_nodes_refuses_a_train_flag_train_refuses(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main([*NODES, "train", "--pp", "2", "--bogus"])
    assert exited.value.code == 2
    assert capsys.readouterr().err.endswith("stagewise nodes: error: unrecognized arguments: --bogus\n")


@pytest.mark.parametrize(
    ("text", "endpoint"),
    [("node0:29500", Endpoint("node0", 29500)), ("[fe80::1]:80", Endpoint("fe80::1", 80)), ("10.0.0.1:1", None)],
)
def test_an_endpoint_reads_back_as_written(text: str, endpoint: Endpoint | None) -> None:
    read = endpoint_of(text)
    assert str(read) == text
    if endpoint is not None:
        assert read == endpoint


def test_a_node_launch_checks_its_values() -> None:
    with pytest.raises(ValueError, match=r"^processes per node must be >= 1, got 0$"):
        NodeLaunch(2, 0, Endpoint("node0", 29500), "4242")
    with pytest.raises(ValueError, match=r"^the rendezvous endpoint 'a:b:1' holds a ':' in its host, but 'a:b' is no"):
        endpoint_of("a:b:1")
    launch = NodeLaunch(3, 4, Endpoint("node0", 29500), "job.7")
    assert launch.world_size == 12
    assert launch.argv()[-3:] == ["-m", "stagewise", "train"]


def test_the_guide_shows_what_nodes_prints(capsys: pytest.CaptureFixture[str]) -> None:
    """docs/launching.md's example of ``stagewise nodes`` and the output it shows, which the docs' tests cannot
    compare (they run the command, and check its exit status)."""
    page = (Path(__file__).resolve().parents[2] / "docs" / "launching.md").read_text()
    command = re.search(r"```bash\n(python -m stagewise nodes .*?)\n```", page, re.DOTALL)
    shown = re.search(r"```text\n(torchrun .*?)\n```", page)
    assert command is not None and shown is not None
    argv = shlex.split(command[1].replace("\\\n", " "))
    assert argv[:3] == ["python", "-m", "stagewise"]
    assert main(argv[3:]) == 0
    assert capsys.readouterr().out == shown[1] + "\n"
