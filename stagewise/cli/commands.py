"""The commands of the command line, each named with its one-line help and the module that holds its flags.

A command's module is imported only when the command is chosen, so ``stagewise --help`` and a command that
needs no torch (``schedule``) start without importing torch.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Command:
    """One command: the module whose ``add(commands)`` declares its flags and whose ``run(ns)`` runs it."""

    module: str
    help: str


COMMANDS: dict[str, Command] = {
    "train": Command("stagewise.cli.train", "train a model with a pipeline (the main job)"),
    "plan": Command(
        "stagewise.cli.plan", "choose pp x dp, micro-batches, schedule and checkpointing; predict step time and memory"
    ),
    "partition": Command("stagewise.cli.partition", "profile a model and print its optimal split into stages"),
    "schedule": Command(
        "stagewise.cli.schedule", "validate, simulate and draw a schedule, or synthesise one for your stages"
    ),
    "tokenize": Command("stagewise.cli.tokenize", "tokenize a corpus into a token file that train --data reads"),
    "nodes": Command("stagewise.cli.nodes", "print the torchrun command each node of a job on several nodes runs"),
}
"""Every command, in the order the help lists them."""
