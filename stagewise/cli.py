"""The command line: ``partition`` prints a model's optimal split; ``schedule`` checks, times and draws a schedule."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import get_args

from stagewise.models import PRESETS
from stagewise.partition import By, MemorySchedule, balance_costs, profile
from stagewise.pipeline import Schedule, ScheduleName, StageCosts, render, simulate, to_chrome_trace
from stagewise.pipeline import build as build_schedule
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
    sched = commands.add_parser(
        "schedule",
        help="validate, simulate and draw a pipeline schedule",
        description="Build a schedule (or read one from a file), check it, simulate one step with the "
        "given per-stage costs, and print its step time, bubble and peak micro-batches in flight.",
    )
    source = sched.add_mutually_exclusive_group(required=True)
    source.add_argument("name", nargs="?", choices=get_args(ScheduleName), help="a built-in schedule")
    source.add_argument("--file", type=Path, help="a schedule in text form ('rank 0: 0F0 0F1 0B0 ...')")
    sched.add_argument("--stages", type=_positive_int, default=4, help="stages (ranks x virtual stages)")
    sched.add_argument("--microbatches", type=_positive_int, default=8, help="micro-batches per step")
    sched.add_argument("--virtual", type=_positive_int, default=1, help="stages per rank (interleaved)")
    sched.add_argument("--forward", type=float, default=1.0, help="time of one forward, per stage")
    sched.add_argument("--backward", type=float, default=None, help="time of one backward (default 2x forward)")
    sched.add_argument("--input-grad", type=float, default=None, help="time of I (default half of backward)")
    sched.add_argument("--weight-grad", type=float, default=None, help="time of W (default the rest)")
    sched.add_argument("--transfer", type=float, default=0.0, help="time to send between ranks")
    sched.add_argument("--text", action="store_true", help="print the schedule's actions")
    sched.add_argument("--picture", type=Path, default=None, help="draw the timeline here (.png or .svg)")
    sched.add_argument("--trace", type=Path, default=None, help="write a Chrome/Perfetto trace here")
    return top


def _schedule(args: argparse.Namespace) -> int:
    if args.file is not None:
        schedule = Schedule.load(args.file)
    else:
        schedule = build_schedule(args.name, args.stages, args.microbatches, n_virtual=args.virtual)
    costs = StageCosts.of(
        schedule.n_stages,
        forward=args.forward,
        backward=args.backward,
        input_grad=args.input_grad,
        weight_grad=args.weight_grad,
        transfer=args.transfer,
    )
    result = simulate(schedule, costs)
    if args.text:
        print(schedule.to_text(), end="")
    print(
        f"{schedule.name}: {schedule.n_stages} stages on {schedule.n_ranks} ranks, "
        f"{schedule.n_microbatches} micro-batches: valid"
    )
    print(f"step time {result.step_time:g}, bubble {result.bubble:.1%}")
    print("peak micro-batches in flight per stage: " + " ".join(str(q) for q in result.peak_in_flight))
    for rank, (busy, idle) in enumerate(zip(result.busy, result.idle, strict=True)):
        print(f"rank {rank}: busy {busy:g}, idle {idle:g}")
    if args.picture is not None:
        title = f"{schedule.name}: {schedule.n_ranks} ranks, {schedule.n_microbatches} micro-batches, "
        render(result.timeline, args.picture, title=title + f"step {result.step_time:g}, bubble {result.bubble:.1%}")
        print(f"wrote {args.picture}")
    if args.trace is not None:
        to_chrome_trace(result.timeline, args.trace)
        print(f"wrote {args.trace}")
    return 0


def _partition(args: argparse.Namespace) -> int:
    config = PRESETS[args.model]
    model = config.build(device="meta")
    sample = config.example(args.micro_batch_size, args.seq_len)
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
    total = sum(p.numel() for p in model.parameters())  # a tied parameter once
    shape = "x".join(str(d) for d in sample.shape)
    print(
        f"{args.model}: {len(costs)} layers, {total:,} parameters; micro-batch of shape {shape}, "
        f"{args.microbatches} micro-batches, {args.schedule}; balanced by {args.by}"
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
        return _schedule(args) if args.command == "schedule" else _partition(args)
    except (ValueError, TypeError, OSError, ImportError) as err:
        print(f"stagewise {args.command}: error: {err}", file=sys.stderr)
        return 2
