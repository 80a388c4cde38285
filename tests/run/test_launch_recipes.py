"""The recipes for several nodes, run here: examples/slurm/train.sbatch under a stand-in srun (2 nodes x 2
processes train a tiny job through torchrun's c10d rendezvous on 127.0.0.1), and examples/kubernetes/
torchrun-node.sh in a PyTorchJob's and a JobSet's environment (the torchrun it would run, read from its
manifest). Each runs the command ``stagewise nodes`` prints for the same job."""

from __future__ import annotations

import contextlib
import json
import math
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from stagewise.cli import main

ROOT = Path(__file__).resolve().parents[2]
SBATCH = ROOT / "examples" / "slurm" / "train.sbatch"
NODE_SCRIPT = ROOT / "examples" / "kubernetes" / "torchrun-node.sh"
MANIFESTS = ROOT / "examples" / "kubernetes"
JOB_ID = "4242"
TINY = ["--model", "gpt-tiny", "--pp", "2", "--dp", "2", "--steps", "3", "--batch-size", "8"]
TINY += ["--microbatches", "2", "--seq-len", "32", "--eval-batches", "1", "--data-limit", "256KiB", "--log-every", "1"]
LAUNCH_TIMEOUT = 150.0  # seconds for the whole job: its launch takes about 10 s here

# srun --ntasks-per-node=1 as train.sbatch uses it: the command once on each node, all at once, each with its
# node's SLURM variables (node i: SLURM_NODEID=SLURM_PROCID=i); its options and the command are recorded.
FAKE_SRUN = r"""#!/bin/bash
set -u
while [[ $1 == -* ]]; do printf '%s\n' "$1" >>"$FAKE_SLURM/srun-options"; shift; done
printf '%s\n' "$@" >"$FAKE_SLURM/command"
[[ ${FAKE_SRUN_RECORD_ONLY:-} ]] && exit 0
for ((node = 0; node < SLURM_NNODES; node++)); do
    (
        export SLURM_NODEID=$node SLURM_PROCID=$node SLURM_LOCALID=0 SLURM_STEPID=0
        "$@" >"$FAKE_SLURM/node$node.log" 2>&1
        echo $? >"$FAKE_SLURM/node$node.status"
    ) &
done
wait
! grep -qvx 0 "$FAKE_SLURM"/node*.status  # srun fails when a task does
"""
# scontrol show hostnames for the simulated job's node list: both "nodes" are this machine. It writes one host
# at a time, as the real one does for a long list: a reader that stops after the first line stops it (SIGPIPE).
FAKE_SCONTROL = r"""#!/bin/bash
[[ "$1 $2 $3" == "show hostnames sim[0-1]" ]] || { echo "fake scontrol: unexpected $*" >&2; exit 1; }
echo 127.0.0.1
sleep 0.2
echo 127.0.0.2
"""
# torchrun, as far as the Kubernetes script runs it: its arguments are written down, nothing starts.
FAKE_TORCHRUN = r"""#!/bin/bash
printf '%s\n' torchrun "$@" >"$FAKE_TORCHRUN_ARGV"
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _tools(folder: Path, **scripts: str) -> Path:
    """A folder of stand-in commands (name -> script), executable."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in scripts.items():
        path = folder / name
        path.write_text(text)
        path.chmod(0o755)
    return folder


def _clean_environment(path: list[Path]) -> dict[str, str]:
    """This environment without a scheduler's or torchrun's variables, ``path`` first on PATH (then this
    interpreter's folder, for torchrun and python), stagewise importable, one thread per process, no GPU."""
    inherited = ("SLURM_", "SRUN_", "PET_", "TORCHELASTIC_", "MASTER_", "JOB_COMPLETION_INDEX", "STAGEWISE_JOB_ID")
    env = {k: v for k, v in os.environ.items() if not k.startswith(inherited)}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NNODES", "NPROC_PER_NODE"):
        env.pop(name, None)
    folders = [*map(str, path), str(Path(sys.executable).parent), env.get("PATH", "")]
    env["PATH"] = os.pathsep.join(folders)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.update(OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    return env


def _slurm_environment(bin_folder: Path, record: Path, port: int, nodelist: str) -> dict[str, str]:
    """What sbatch sets for a job of 2 nodes (one task each) that runs train.sbatch, on this machine."""
    env = _clean_environment([bin_folder])
    env.update(
        SLURM_JOB_ID=JOB_ID, SLURM_JOBID=JOB_ID, SLURM_JOB_NAME="stagewise", SLURM_NNODES="2",
        SLURM_JOB_NUM_NODES="2", SLURM_NTASKS="2", SLURM_NPROCS="2", SLURM_NTASKS_PER_NODE="1",
        SLURM_JOB_NODELIST=nodelist, SLURM_NODELIST=nodelist, SLURM_NODEID="0", SLURM_PROCID="0",
        SLURM_CPUS_PER_TASK="1", SLURM_GPUS_ON_NODE="2", SLURM_SUBMIT_DIR=str(record),
        STAGEWISE_PORT=str(port), FAKE_SLURM=str(record),
    )  # fmt: skip
    return env


def _process_tree(root: int) -> list[int]:
    """``root`` and every process below it (torchrun's workers are sessions of their own: a group kill misses
    them)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            children.setdefault(int(stat[stat.rindex(")") + 2 :].split()[1]), []).append(int(entry.name))
    tree, queue = [], [root]
    while queue:
        pid = queue.pop()
        tree.append(pid)
        queue.extend(children.get(pid, []))
    return tree


def _kill_tree(root: int) -> None:
    for pid in _process_tree(root):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _nodes_command(
    capsys: pytest.CaptureFixture[str], nodes: int, endpoint: str, job_id: str, flags: list[str]
) -> list[str]:
    """The torchrun command ``stagewise nodes`` prints for ``flags`` on ``nodes`` nodes, as arguments."""
    capsys.readouterr()
    assert (
        main(["nodes", "--nnodes", str(nodes), "--rdzv-endpoint", endpoint, "--rdzv-id", job_id, "train", *flags]) == 0
    )
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1, out  # the command alone on stdout; what it means goes to stderr
    return shlex.split(out[0])


@dataclass(frozen=True)
class SlurmRun:
    """The simulated SLURM job: train.sbatch's exit status and output, the folder of what srun recorded and
    of each node's output, the run's folder, and the port the nodes met on."""

    status: int
    output: str
    record: Path
    out: Path
    port: int
    seconds: float

    def node(self, i: int) -> tuple[str, str]:
        """Node ``i``'s torchrun: its exit status and output."""
        status = self.record / f"node{i}.status"
        return (status.read_text().strip() if status.exists() else "none"), (self.record / f"node{i}.log").read_text()


@pytest.fixture(scope="module")
def slurm_run(tmp_path_factory: pytest.TempPathFactory) -> SlurmRun:
    """train.sbatch for 2 nodes of 2 processes, its srun and scontrol stand-ins on PATH: one launch, shared."""
    folder = tmp_path_factory.mktemp("slurm")
    record, out = folder / "record", folder / "run"
    record.mkdir()
    bin_folder = _tools(folder / "bin", srun=FAKE_SRUN, scontrol=FAKE_SCONTROL)
    port = _free_port()
    env = _slurm_environment(bin_folder, record, port, "sim[0-1]")
    began = time.monotonic()
    with (folder / "sbatch.log").open("w+") as log:
        job = subprocess.Popen(
            ["bash", str(SBATCH), *TINY, "--out", str(out)], cwd=folder, env=env, stdout=log,
            stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        try:
            status = job.wait(timeout=LAUNCH_TIMEOUT)
        except subprocess.TimeoutExpired:
            _kill_tree(job.pid)
            job.wait()
            logs = "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(record.glob("node*.log")))
            pytest.fail(f"train.sbatch did not finish within {LAUNCH_TIMEOUT:g} s; killed it\n{logs}")
        log.seek(0)
        output = log.read()
    return SlurmRun(status, output, record, out, port, time.monotonic() - began)


@pytest.mark.timeout(240)
def test_the_slurm_script_trains_on_two_nodes_of_two_processes(slurm_run: SlurmRun) -> None:
    nodes = [slurm_run.node(i) for i in (0, 1)]
    report = "\n".join(f"--- node {i}: status {s}\n{text[-3000:]}" for i, (s, text) in enumerate(nodes))
    assert slurm_run.status == 0, f"{slurm_run.output}\n{report}"
    assert [status for status, _ in nodes] == ["0", "0"], report
    # Rank 0 (on whichever node the rendezvous made first) saw 4 processes, 2 on its node: it says where they met.
    said = [text for _, text in nodes if "stagewise train: 4 processes on several nodes" in text]
    assert len(said) == 1, report
    assert f"(job id {JOB_ID})" in said[0] and "steps 1..3: loss" in said[0]
    steps = [json.loads(line) for line in (slurm_run.out / "metrics.jsonl").read_text().splitlines()]
    steps = [step for step in steps if "loss" in step]
    assert [step["step"] for step in steps] == [1, 2, 3]
    assert all(math.isfinite(step["loss"]) and math.isfinite(step["grad_norm"]) for step in steps)
    assert all(len(step["peak_memory"]) == 4 for step in steps), "every rank of the 4 reports its memory"
    summary = json.loads((slurm_run.out / "summary.json").read_text())
    assert summary["config"]["pp"] * summary["config"]["dp"] == 4
    assert len(summary["losses"]) == 3 and all(math.isfinite(loss) for loss in summary["losses"])


@pytest.mark.timeout(240)
def test_srun_runs_the_command_stagewise_nodes_prints_once_per_node(
    slurm_run: SlurmRun, capsys: pytest.CaptureFixture[str]
) -> None:
    options = (slurm_run.record / "srun-options").read_text().split()
    assert "--ntasks-per-node=1" in options
    command = (slurm_run.record / "command").read_text().splitlines()
    flags = [*TINY, "--out", str(slurm_run.out)]
    assert command == _nodes_command(capsys, 2, f"127.0.0.1:{slurm_run.port}", JOB_ID, flags)


def _sbatch_record_only(tmp_path: Path, nodelist: str) -> tuple[subprocess.CompletedProcess[str], Path]:
    """train.sbatch where there is no scontrol, its srun recording the command alone."""
    record = tmp_path / "record"
    record.mkdir()
    bin_folder = _tools(tmp_path / "bin", srun=FAKE_SRUN)
    env = _slurm_environment(bin_folder, record, 29500, nodelist)
    env["FAKE_SRUN_RECORD_ONLY"] = "1"
    env["PATH"] = os.pathsep.join([str(bin_folder), str(Path(sys.executable).parent), "/usr/bin", "/bin"])
    if shutil.which("scontrol", path=env["PATH"]):
        pytest.skip("scontrol is installed here: the script's way without it cannot be seen")
    done = subprocess.run(
        ["bash", str(SBATCH), "--model", "gpt-tiny"], env=env, capture_output=True, text=True, timeout=30, check=False
    )
    return done, record


def test_without_scontrol_the_slurm_script_meets_at_the_first_node_of_a_plain_list(tmp_path: Path) -> None:
    done, record = _sbatch_record_only(tmp_path, "127.0.0.1,127.0.0.2")
    assert done.returncode == 0, done.stderr
    command = (record / "command").read_text().splitlines()
    assert command[command.index("--rdzv-endpoint") + 1] == "127.0.0.1:29500"
    assert command[command.index("--nproc-per-node") + 1] == "2"  # SLURM_GPUS_ON_NODE


def test_without_scontrol_a_range_of_nodes_is_refused_with_the_reason(tmp_path: Path) -> None:
    done, record = _sbatch_record_only(tmp_path, "sim[0-1]")
    assert done.returncode == 2
    assert done.stderr == "train.sbatch: cannot read the first node of sim[0-1] without scontrol\n"
    assert not (record / "command").exists()


def _manifest(name: str) -> dict[str, Any]:
    loaded = yaml.safe_load((MANIFESTS / name).read_text())
    assert isinstance(loaded, dict)
    return loaded


def _node_script(tmp_path: Path, env: dict[str, str], node: int, args: list[str]) -> subprocess.CompletedProcess[str]:
    """torchrun-node.sh for pod ``node`` with the train flags ``args``, ``env`` as its operator and manifest set
    it; its torchrun writes its arguments down, nothing starts."""
    bin_folder = _tools(tmp_path / "bin", torchrun=FAKE_TORCHRUN)
    full = _clean_environment([bin_folder]) | env | {"FAKE_TORCHRUN_ARGV": str(tmp_path / f"argv{node}")}
    return subprocess.run(
        ["bash", str(NODE_SCRIPT), *args], env=full, capture_output=True, text=True, timeout=30, check=False
    )


def _container(pod: dict[str, Any]) -> dict[str, Any]:
    (container,) = pod["spec"]["containers"]
    assert isinstance(container, dict)
    assert container["command"] == ["bash", "/opt/stagewise/torchrun-node.sh"]
    assert any(m["mountPath"] == "/opt/stagewise" for m in container["volumeMounts"])
    return container


def _pod_commands(tmp_path: Path, args: list[str], envs: list[dict[str, str]]) -> list[list[str]]:
    """The torchrun each pod's node script runs, given each pod's environment."""
    commands = []
    for node, env in enumerate(envs):
        done = _node_script(tmp_path, env, node, args)
        assert done.returncode == 0, done.stderr
        commands.append((tmp_path / f"argv{node}").read_text().splitlines())
    return commands


def _with_host(command: list[str], node: int) -> list[str]:
    """``stagewise nodes``' command with the pod's is_host, as the node script adds it (the first pod hosts)."""
    at = command.index("-m")
    return [*command[:at], "--rdzv-conf", f"is_host={int(node == 0)}", *command[at:]]


def test_a_pytorchjob_pod_runs_the_command_stagewise_nodes_prints(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    job = _manifest("pytorchjob.yaml")
    specs = job["spec"]["pytorchReplicaSpecs"]
    assert specs["Master"]["template"] == specs["Worker"]["template"]
    container = _container(specs["Master"]["template"])
    nodes = specs["Master"]["replicas"] + specs["Worker"]["replicas"]
    per_node = int(job["spec"]["nprocPerNode"])
    assert container["resources"]["limits"]["nvidia.com/gpu"] == per_node
    (job_id,) = [e for e in container["env"] if e["name"] == "STAGEWISE_JOB_ID"]
    assert job_id["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.labels['training.kubeflow.org/job-name']"
    name = job["metadata"]["name"]
    # What the training operator sets in pod k (the master's is 0), and the job id the manifest reads.
    operator = {"PET_NNODES": str(nodes), "PET_NPROC_PER_NODE": str(per_node), "MASTER_ADDR": f"{name}-master-0"}
    operator |= {"MASTER_PORT": "23456", "WORLD_SIZE": str(nodes * per_node), "PYTHONUNBUFFERED": "0"}
    envs = [operator | {"PET_NODE_RANK": str(k), "RANK": str(k), "STAGEWISE_JOB_ID": name} for k in range(nodes)]
    commands = _pod_commands(tmp_path, container["args"], envs)
    expected = _nodes_command(capsys, nodes, f"{name}-master-0:23456", name, container["args"])
    assert expected[expected.index("--nproc-per-node") + 1] == str(per_node)  # the manifest fills its nodes
    assert commands == [_with_host(expected, k) for k in range(nodes)]


def test_a_jobset_pod_runs_the_command_stagewise_nodes_prints(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    jobset = _manifest("jobset.yaml")
    (replicated,) = jobset["spec"]["replicatedJobs"]
    job = replicated["template"]["spec"]
    assert replicated["replicas"] == 1 and job["completionMode"] == "Indexed"
    assert job["parallelism"] == job["completions"]
    container = _container(job["template"])
    env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    name = jobset["metadata"]["name"]
    assert env["NNODES"] == str(job["parallelism"])
    assert container["resources"]["limits"]["nvidia.com/gpu"] == int(env["NPROC_PER_NODE"])
    # The first pod's name, as JobSet names it: <jobset>-<replicated job>-<job index>-<pod index>.<jobset>
    assert env["MASTER_ADDR"] == f"{name}-{replicated['name']}-0-0.{name}"
    (job_id,) = [e for e in container["env"] if e["name"] == "STAGEWISE_JOB_ID"]
    assert job_id["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.labels['jobset.sigs.k8s.io/jobset-uid']"
    uid = "0b7e1c1e-8a55-4c61-9a55-3f1b5c2d9e10"
    nodes = job["parallelism"]
    envs = [env | {"JOB_COMPLETION_INDEX": str(k), "STAGEWISE_JOB_ID": uid} for k in range(nodes)]
    commands = _pod_commands(tmp_path, container["args"], envs)
    expected = _nodes_command(capsys, nodes, f"{env['MASTER_ADDR']}:{env['MASTER_PORT']}", uid, container["args"])
    assert commands == [_with_host(expected, k) for k in range(nodes)]


@pytest.mark.parametrize(
    ("missing", "message"),
    [
        ("NNODES", "NNODES: set NNODES, the number of pods (nodes) of the job"),
        ("MASTER_ADDR", "MASTER_ADDR: set MASTER_ADDR, the host name of the job's first pod"),
        ("STAGEWISE_JOB_ID", "STAGEWISE_JOB_ID: set STAGEWISE_JOB_ID, an id of this job's own, the same in every pod"),
        ("JOB_COMPLETION_INDEX", "RANK: set JOB_COMPLETION_INDEX or RANK, this pod's index"),
    ],
)
def test_the_node_script_names_what_its_pod_lacks(tmp_path: Path, missing: str, message: str) -> None:
    env = {"NNODES": "2", "NPROC_PER_NODE": "2", "JOB_COMPLETION_INDEX": "1", "MASTER_ADDR": "first-pod"}
    env["STAGEWISE_JOB_ID"] = "job-7"
    del env[missing]
    done = _node_script(tmp_path, env, 0, ["--model", "gpt-tiny"])
    assert done.returncode != 0 and message in done.stderr
    assert not (tmp_path / "argv0").exists()


@pytest.mark.parametrize("script", [SBATCH, NODE_SCRIPT], ids=lambda p: p.name)
def test_the_scripts_pass_shellcheck(script: Path) -> None:
    assert subprocess.run(["bash", "-n", str(script)], check=False).returncode == 0
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck is not installed (apt-get install shellcheck); bash -n passed")
    done = subprocess.run(["shellcheck", str(script)], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stdout
