"""The command line: ``train`` runs the main job, ``plan`` picks its layout, ``partition`` and ``schedule`` inspect,
``tokenize`` prepares data, ``nodes`` prints the torchrun command of each node of a job on several nodes."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from typing import Any

from stagewise.cli import nodes, partition, plan, schedule, tokenize, train
from stagewise.cli.args import DefaultsFormatter
from stagewise.comm import LaunchError
from stagewise.run.launching import JobFailedError
from stagewise.run.rank import LOG_FORMAT


class _WithDefaults(argparse.ArgumentParser):
    """A command's parser, whose help shows each option's default."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", DefaultsFormatter)
        super().__init__(*args, **kwargs)


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(
        prog="stagewise",
        description="The command line of stagewise: train runs the main job, plan picks its layout, partition and "
        "schedule inspect a split and a schedule.",
    )
    top.add_argument("-v", "--verbose", action="store_true", help="log debug messages to stderr")
    commands = top.add_subparsers(dest="command", required=True, parser_class=_WithDefaults)
    train.add(commands)
    plan.add(commands)
    partition.add(commands)
    schedule.add(commands)
    tokenize.add(commands)
    nodes.add(commands)
    return top


def main(argv: Sequence[str] | None = None) -> int:
    ns = parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if ns.verbose else logging.WARNING, format=LOG_FORMAT)
    run = {
        "train": train.run, "plan": plan.run, "partition": partition.run, "schedule": schedule.run,
        "tokenize": tokenize.run, "nodes": nodes.run,
    }[ns.command]  # fmt: skip
    try:
        return run(ns)
    except (ValueError, TypeError, OSError, ImportError) as err:
        print(f"stagewise {ns.command}: error: {err}", file=sys.stderr)
        return 2
    except (LaunchError, JobFailedError) as err:
        print(f"stagewise {ns.command}: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # before the processes started, or a second Ctrl-C: no traceback
        print(f"stagewise {ns.command}: interrupted", file=sys.stderr)
        return 130
