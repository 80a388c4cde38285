"""``stagewise schedule``: validate, simulate and draw a pipeline schedule."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, get_args

from stagewise.cli import args
from stagewise.schedule import Schedule, ScheduleName, StageCosts, render, simulate, to_chrome_trace
from stagewise.schedule import build as build_schedule


def add(commands: Any) -> None:
    sched = commands.add_parser(
        "schedule",
        help="validate, simulate and draw a pipeline schedule",
        description="Build a schedule (or read one from a file), check it, simulate one step with the "
        "given per-stage costs, and print its step time, bubble and peak micro-batches in flight.",
    )
    source = sched.add_mutually_exclusive_group(required=True)
    source.add_argument("name", nargs="?", choices=get_args(ScheduleName), help="a built-in schedule")
    source.add_argument("--file", type=Path, help="a schedule in text form ('rank 0: 0F0 0F1 0B0 ...')")
    sched.add_argument(
        "--stages", type=args.positive_int, default=None, help="stages (ranks x virtual stages; default 4)"
    )
    sched.add_argument("--microbatches", type=args.positive_int, default=None, help="micro-batches per step (8)")
    sched.add_argument("--virtual", type=args.positive_int, default=None, help="stages per rank (interleaved; 1)")
    sched.add_argument("--forward", type=float, default=1.0, help="time of one forward, per stage")
    sched.add_argument("--backward", type=float, default=None, help="time of one backward (default 2x forward)")
    sched.add_argument("--input-grad", type=float, default=None, help="time of I (default half of backward)")
    sched.add_argument("--weight-grad", type=float, default=None, help="time of W (default the rest)")
    sched.add_argument("--transfer", type=float, default=0.0, help="time to send between ranks")
    sched.add_argument("--text", action="store_true", help="print the schedule's actions")
    sched.add_argument("--picture", type=Path, default=None, help="draw the timeline here (.png or .svg)")
    sched.add_argument("--trace", type=Path, default=None, help="write a Chrome/Perfetto trace here")


def run(ns: argparse.Namespace) -> int:
    shape = {"--stages": ns.stages, "--microbatches": ns.microbatches, "--virtual": ns.virtual}
    if ns.file is not None:
        given = [flag for flag, value in shape.items() if value is not None]
        if given:
            raise ValueError(
                f"{', '.join(given)} shape a built-in schedule; a --file schedule has its own: leave them out"
            )
        schedule = Schedule.load(ns.file)
    else:
        stages, microbatches, virtual = ns.stages or 4, ns.microbatches or 8, ns.virtual or 1
        schedule = build_schedule(ns.name, stages, microbatches, n_virtual=virtual)
    costs = StageCosts.of(
        schedule.n_stages,
        forward=ns.forward,
        backward=ns.backward,
        input_grad=ns.input_grad,
        weight_grad=ns.weight_grad,
        transfer=ns.transfer,
    )
    result = simulate(schedule, costs)
    if ns.text:
        print(schedule.to_text(), end="")
    print(
        f"{schedule.name}: {schedule.n_stages} stages on {schedule.n_ranks} ranks, "
        f"{schedule.n_microbatches} micro-batches: valid"
    )
    print(f"step time {result.step_time:g}, bubble {result.bubble:.1%}")
    print("peak micro-batches in flight per stage: " + " ".join(str(q) for q in result.peak_in_flight))
    for rank, (busy, idle) in enumerate(zip(result.busy, result.idle, strict=True)):
        print(f"rank {rank}: busy {busy:g}, idle {idle:g}")
    if ns.picture is not None:
        title = f"{schedule.name}: {schedule.n_ranks} ranks, {schedule.n_microbatches} micro-batches, "
        render(result.timeline, ns.picture, title=title + f"step {result.step_time:g}, bubble {result.bubble:.1%}")
        print(f"wrote {ns.picture}")
    if ns.trace is not None:
        to_chrome_trace(result.timeline, ns.trace)
        print(f"wrote {ns.trace}")
    return 0
