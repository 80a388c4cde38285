"""The command line: ``train`` runs the main job, ``plan`` picks its layout, ``partition`` and ``schedule`` inspect,
``tokenize`` prepares data, ``nodes`` prints the torchrun command of each node of a job on several nodes."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence
from typing import Any

from stagewise.cli.args import DefaultsFormatter
from stagewise.cli.commands import COMMANDS
from stagewise.errors import JobFailureError
from stagewise.run.logs import LOG_FORMAT


class _WithDefaults(argparse.ArgumentParser):
    """A command's parser, whose help shows each option's default."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", DefaultsFormatter)
        super().__init__(*args, **kwargs)


def parser(only: str | None = None) -> argparse.ArgumentParser:
    """The command line's parser: every command's flags, or with ``only`` the flags of that command alone (the
    others are named with their help, their modules not imported)."""
    top = argparse.ArgumentParser(
        prog="stagewise",
        description="The command line of stagewise: train runs the main job, plan picks its layout, partition and "
        "schedule inspect a split and a schedule.",
    )
    top.add_argument("-v", "--verbose", action="store_true", help="log debug messages to stderr")
    commands = top.add_subparsers(dest="command", required=True, parser_class=_WithDefaults)
    for name, command in COMMANDS.items():
        if only is None or only == name:
            importlib.import_module(command.module).add(commands)
        else:
            commands.add_parser(name, help=command.help)
    return top


def _chosen(argv: Sequence[str]) -> str:
    """The command ``argv`` names: its first word that is no option (the top level's options take no value)."""
    return next((word for word in argv if not word.startswith("-")), "")


def main(argv: Sequence[str] | None = None) -> int:
    words = list(sys.argv[1:] if argv is None else argv)
    ns = parser(only=_chosen(words)).parse_args(words)
    logging.basicConfig(level=logging.DEBUG if ns.verbose else logging.WARNING, format=LOG_FORMAT)
    run = importlib.import_module(COMMANDS[ns.command].module).run

    try:
        return int(run(ns))
    except (ValueError, TypeError, OSError, ImportError) as err:
        print(f"stagewise {ns.command}: error: {err}", file=sys.stderr)
        return 2
    except JobFailureError as err:
        print(f"stagewise {ns.command}: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # before the processes started, or a second Ctrl-C: no traceback
        print(f"stagewise {ns.command}: interrupted", file=sys.stderr)
        return 130
