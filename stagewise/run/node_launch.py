"""The command each node of a train job on several nodes runs: torchrun, meeting the others at one c10d endpoint.

Every node runs the same command: torchrun's c10d rendezvous numbers the nodes as they join, and the node whose
host is the endpoint's keeps the job's store. Anyone who reaches that endpoint can join or disturb the job, so it
must be on a trusted network, with an id of this job's own (the scheduler's job id).
"""

from __future__ import annotations

import ipaddress
import re
import shlex
from dataclasses import dataclass

from stagewise.run.config import TrainConfig
from stagewise.run.data import needs_tokenizing, tokenizer_of

TORCHRUN = "torchrun"
"""The launcher each node runs (installed with torch)."""
RENDEZVOUS = "c10d"
"""torchrun's rendezvous backend for several nodes: a store on the endpoint's host, which the others reach."""
JOB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
"""What a job id may hold: a scheduler's job id, a Kubernetes uid or name."""
NOWHERE = ("0.0.0.0", "::", "*")
"""Hosts that name no address another node can connect to (a listener's wildcard): refused as endpoints."""


@dataclass(frozen=True)
class Endpoint:
    """``HOST:PORT`` where the nodes meet: the first node's host name or address, and a port free there."""

    host: str
    port: int

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


def endpoint_of(text: str) -> Endpoint:
    """Read ``HOST:PORT`` (``[V6]:PORT`` for an IPv6 address); a value without a host or port is refused."""
    fix = "give the first node's host and a free port there, e.g. node0:29500"
    host, colon, port = text.rpartition(":")
    if text.startswith("["):
        host = host.removeprefix("[").removesuffix("]")
    if not colon or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"the rendezvous endpoint {text!r} is not HOST:PORT with a port 1-65535; {fix}")
    if host in NOWHERE or any(c.isspace() for c in host):
        raise ValueError(f"the rendezvous endpoint {text!r} names no host the nodes can reach; {fix}")
    if ":" in host:
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise ValueError(
                f"the rendezvous endpoint {text!r} holds a ':' in its host, but {host!r} is no IPv6 address; {fix}"
            ) from None
    return Endpoint(host, int(port))


def layout_of(config: TrainConfig) -> str:
    """The flags that make the job's processes: ``--pp 4 x --dp 2`` (with ``--fsdp``, ``--tp`` where > 1)."""
    text = f"--pp {config.pp} x --dp {config.dp}"
    for name in ("fsdp", "tp"):
        if getattr(config, name) > 1:
            text += f" x --{name} {getattr(config, name)}"
    return text if config.ep == 1 else f"{text} (--ep {config.ep})"


@dataclass(frozen=True)
class NodeLaunch:
    """A train job of ``nodes`` nodes, ``procs_per_node`` processes each, whose torchruns meet at ``endpoint``
    under ``job_id``; :meth:`argv` is the command every node runs, with ``train_flags`` after
    ``-m stagewise train``. ``max_restarts`` is torchrun's: it restarts every node's processes after a failure,
    and the run resumes from its latest checkpoint."""

    nodes: int
    procs_per_node: int
    endpoint: Endpoint
    job_id: str
    train_flags: tuple[str, ...] = ()
    max_restarts: int = 0

    def __post_init__(self) -> None:
        if self.nodes < 2:
            raise ValueError(
                f"{self.nodes} node needs no torchrun: python -m stagewise train starts the processes itself, "
                "with its rendezvous on loopback alone; give 2 nodes or more"
            )
        if self.procs_per_node < 1:
            raise ValueError(f"processes per node must be >= 1, got {self.procs_per_node}")
        if not JOB_ID.fullmatch(self.job_id) or self.job_id == "none":
            raise ValueError(
                f"the job id {self.job_id!r} is not one of this job's own; give the scheduler's job id (letters, "
                "digits, '.', '_', '-'), e.g. $SLURM_JOB_ID, a new one for each job"
            )
        if self.max_restarts < 0:
            raise ValueError(f"--max-restarts must be >= 0, got {self.max_restarts}")

    @property
    def world_size(self) -> int:
        return self.nodes * self.procs_per_node

    def argv(self) -> list[str]:
        """The command each node runs (the same on every node)."""
        out = [TORCHRUN, "--nnodes", str(self.nodes), "--nproc-per-node", str(self.procs_per_node)]
        out += ["--rdzv-backend", RENDEZVOUS, "--rdzv-endpoint", str(self.endpoint), "--rdzv-id", self.job_id]
        if self.max_restarts:
            out += ["--max-restarts", str(self.max_restarts)]
        return [*out, "-m", "stagewise", "train", *self.train_flags]

    def command(self) -> str:
        """:meth:`argv` as one line of shell, quoted where it must be."""
        return shlex.join(self.argv())


def node_launch(
    config: TrainConfig,
    nodes: int,
    endpoint: str,
    job_id: str,
    train_flags: tuple[str, ...] = (),
    *,
    procs_per_node: int | None = None,
    max_restarts: int = 0,
) -> NodeLaunch:
    """The launch of ``config`` (parsed from ``train_flags``) on ``nodes`` nodes meeting at ``endpoint``: its
    processes spread evenly over the nodes (``procs_per_node``, if given, checked against them), its data read
    as it is by every rank (torchrun runs nothing before the ranks, so data to tokenize is refused)."""
    world, layout = config.world_size, layout_of(config)
    if procs_per_node is not None and nodes * procs_per_node != world:
        raise ValueError(
            f"{nodes} nodes x {procs_per_node} processes are {nodes * procs_per_node} processes, but the job has "
            f"{world} ({layout}); change those flags, or the nodes or processes per node"
        )
    if world % nodes:
        raise ValueError(
            f"the job's {world} processes ({layout}) do not split evenly over {nodes} nodes; choose a number of "
            f"nodes that divides {world}, or change those flags"
        )
    if needs_tokenizing(config):
        data = config.data or "(the Python standard library's source)"
        raise ValueError(
            f"the data {data} must be tokenized before torchrun starts the ranks (tokenizer "
            f"{tokenizer_of(config)}): run python -m stagewise tokenize --data ... --tokenizer ... --out DIR, "
            "with DIR where every node reads it, then give --data DIR"
        )
    return NodeLaunch(nodes, world // nodes, endpoint_of(endpoint), job_id, train_flags, max_restarts)
