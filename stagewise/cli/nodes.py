"""``stagewise nodes``: print the torchrun command each node of a train job on several nodes runs (it starts
nothing)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from stagewise.cli import args, train
from stagewise.cli.commands import COMMANDS
from stagewise.run.node_launch import node_launch

USAGE = "stagewise nodes --nnodes 2 --rdzv-endpoint HOST:PORT --rdzv-id JOB_ID train --model ... --pp ... --dp ..."


def add(commands: Any) -> None:
    p = commands.add_parser(
        "nodes",
        help=COMMANDS["nodes"].help,
        description="Print the torchrun command that each node runs for a train job on several nodes (the same "
        "command on every node; torchrun's c10d rendezvous numbers the nodes). The train flags are checked as "
        "train checks them, and the job's processes (--pp x --dp x --fsdp x --tp) are spread evenly over the "
        "nodes. It starts nothing. Anyone who reaches the endpoint can join or disturb the job: keep the nodes on "
        "a trusted network, and give each job an id of its own.",
        usage=USAGE,
    )
    p.add_argument("--nnodes", type=args.positive_int, required=True, metavar="N", help="how many nodes (2 or more)")
    p.add_argument(
        "--rdzv-endpoint", required=True, metavar="HOST:PORT",
        help="the first node's host name (or address) and a port free there, where every node's torchrun meets",
    )  # fmt: skip
    p.add_argument(
        "--rdzv-id", required=True, metavar="JOB_ID",
        help="this job's own id, the same on every node and new for each job (e.g. $SLURM_JOB_ID)",
    )  # fmt: skip
    p.add_argument(
        "--nproc-per-node", type=args.positive_int, default=None, metavar="N",
        help="check that the job has N processes (one per GPU) on each node (default: the job's processes / "
        "--nnodes)",
    )  # fmt: skip
    p.add_argument(
        "--max-restarts", type=int, default=0,
        help="torchrun restarts every node's processes this often after a failure; the run resumes from its "
        "latest checkpoint",
    )  # fmt: skip
    p.add_argument("train", nargs=argparse.REMAINDER, metavar="train FLAGS", help="the train command, last")


def _train_flags(ns: argparse.Namespace) -> argparse.Namespace:
    """The train command after the nodes' flags, parsed and checked as ``stagewise train`` parses them."""
    if not ns.train or ns.train[0] != "train":
        given = " ".join(ns.train) or "nothing"
        raise ValueError(f"nodes needs the train command last, not {given}; write: {USAGE}")
    parser = argparse.ArgumentParser(prog="stagewise nodes", usage=USAGE)
    train.add(parser.add_subparsers(dest="command", required=True))
    parsed = parser.parse_args(ns.train)
    if parsed.pin_cores:
        raise ValueError("--pin-cores applies when stagewise starts the processes; torchrun starts them: leave it out")
    if parsed.max_restarts:
        raise ValueError(
            f"train --max-restarts {parsed.max_restarts} applies when stagewise starts the processes; give it to "
            "nodes before the train command (torchrun's --max-restarts)"
        )
    return parsed


def run(ns: argparse.Namespace) -> int:
    parsed = _train_flags(ns)
    config = train.config_of(parsed)
    launch = node_launch(
        config, ns.nnodes, ns.rdzv_endpoint, ns.rdzv_id, tuple(ns.train[1:]),
        procs_per_node=ns.nproc_per_node, max_restarts=ns.max_restarts,
    )  # fmt: skip
    print(
        f"# each of the {launch.nodes} nodes runs this ({launch.procs_per_node} "
        f"process{'es' if launch.procs_per_node > 1 else ''} each, "
        f"{launch.world_size} in all); the job's store is {launch.endpoint}: keep it on a trusted network",
        file=sys.stderr,
    )
    if parsed.out is None:
        print(
            "# no --out: each node writes stagewise-run/ in its own working folder; give --out on storage that "
            "every node shares, so that the run's checkpoints are whole",
            file=sys.stderr,
        )
    print(launch.command(), flush=True)
    return 0
