"""The command line: ``stagewise partition`` profiles a model and prints its optimal split."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import get_args

import torch

from stagewise.models import PRESETS, build
from stagewise.partition import By, MemorySchedule, balance_costs, profile
from stagewise.units import format_bytes, parse_bytes


def _sizes(text: str) -> list[float]:
    return [parse_bytes(part) for part in text.split(",")]


def _floats(text: str) -> list[float]:
    try:
        return [float(part) for part in text.split(",")]
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from err


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from err
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a number >= 1, got {value}")
    return value


def _per_stage(values: list[float] | None, n_stages: int, what: str) -> list[float] | None:
    if values is None or len(values) == n_stages:
        return values
    if len(values) == 1:
        return values * n_stages
    raise ValueError(f"--{what} has {len(values)} values for {n_stages} stages; give one, or one per stage")


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="stagewise", description=__doc__)
    top.add_argument("-v", "--verbose", action="store_true", help="log debug messages to stderr")
    commands = top.add_subparsers(dest="command", required=True)
    part = commands.add_parser(
        "partition",
        help="profile a model and print its optimal split into pipeline stages",
        description="Profile a model layer by layer (on the meta device unless --by time) and print "
        "the split into stages that minimises the slowest stage, within each device's memory.",
    )
    part.add_argument("--model", default="gpt-small", choices=sorted(PRESETS), help="model preset")
    part.add_argument("--stages", type=_positive_int, default=4, help="number of pipeline stages")
    part.add_argument("--by", default="flops", choices=get_args(By), help="what a stage's load counts")
    part.add_argument("--micro-batch-size", type=_positive_int, default=1, help="sequences per micro-batch")
    part.add_argument("--seq-len", type=_positive_int, default=None, help="tokens per sequence (preset's)")
    part.add_argument("--microbatches", type=_positive_int, default=8, help="micro-batches per step")
    part.add_argument("--schedule", default="1f1b", choices=get_args(MemorySchedule), help="for memory")
    part.add_argument("--capacity", type=_sizes, default=None, help="device memory, e.g. 80GiB, or one per stage")
    part.add_argument("--speeds", type=_floats, default=None, help="relative device speeds, one per stage")
    part.add_argument("--state-multiplier", type=float, default=4.0, help="parameter copies kept (4: Adam)")
    part.add_argument("--device", default="cpu", help="where --by time measures")
    part.add_argument("--json", type=Path, default=None, help="also write the partition as JSON here")
    return top


def _partition(args: argparse.Namespace) -> int:
    config = PRESETS[args.model]
    seq_len = args.seq_len or config.seq_len
    if seq_len > config.seq_len:
        raise ValueError(f"--seq-len {seq_len} exceeds {args.model}'s longest sequence {config.seq_len}")
    model = build(args.model, device="meta")
    sample = torch.zeros(args.micro_batch_size, seq_len, dtype=torch.long)
    timed = args.by == "time"
    costs = profile(model, sample, time=timed, device=args.device if timed else None, progress=timed)
    part = balance_costs(
        costs,
        args.stages,
        by=args.by,
        speeds=_per_stage(args.speeds, args.stages, "speeds"),
        capacities=_per_stage(args.capacity, args.stages, "capacity"),
        schedule=args.schedule,
        n_microbatches=args.microbatches,
        state_multiplier=args.state_multiplier,
    )
    total = sum(c.params for c in costs)
    print(
        f"{args.model}: {len(costs)} layers, {total:,} parameters; micro-batch {args.micro_batch_size} x "
        f"{seq_len} tokens, {args.microbatches} micro-batches, {args.schedule}; balanced by {args.by}"
    )
    print(part.report())
    if part.memory is not None:
        print(f"peak stage memory {format_bytes(max(part.memory))} ({args.schedule}, state x{args.state_multiplier:g})")
    if args.json is not None:
        args.json.write_text(part.to_json() + "\n")
        print(f"wrote {args.json}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING, format="%(name)s: %(message)s")
    try:
        return _partition(args)
    except (ValueError, TypeError, OSError) as err:
        print(f"stagewise {args.command}: error: {err}", file=sys.stderr)
        return 2
