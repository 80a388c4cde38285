"""The command line: ``train`` runs the main job, ``plan`` picks its layout, ``partition`` and ``schedule`` inspect."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from stagewise.cli import partition, plan, schedule, train
from stagewise.cli.args import LOG_FORMAT, JobFailedError
from stagewise.comm import LaunchError


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="stagewise", description=__doc__)
    top.add_argument("-v", "--verbose", action="store_true", help="log debug messages to stderr")
    commands = top.add_subparsers(dest="command", required=True)
    train.add(commands)
    plan.add(commands)
    partition.add(commands)
    schedule.add(commands)
    return top


def main(argv: Sequence[str] | None = None) -> int:
    ns = parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if ns.verbose else logging.WARNING, format=LOG_FORMAT)
    run = {"train": train.run, "plan": plan.run, "partition": partition.run, "schedule": schedule.run}[ns.command]
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
