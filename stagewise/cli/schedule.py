"""``stagewise schedule``: validate, simulate and draw a pipeline schedule."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, get_args

from stagewise.cli import args
from stagewise.cli.commands import COMMANDS
from stagewise.schedule import Schedule, ScheduleName, StageCosts, render, simulate, synthesise, to_chrome_trace
from stagewise.schedule import build as build_schedule

AUTO = "auto"
"""The name that asks for a schedule synthesised for the given per-stage costs."""


def add(commands: Any) -> None:
    sched = commands.add_parser(
        "schedule",
        help=COMMANDS["schedule"].help,
        description="Build a schedule (or read one from a file, or synthesise one for the given per-stage costs "
        "with 'auto'), check it, simulate one step with those costs, and print its step time, bubble and peak "
        "micro-batches in flight.",
    )
    source = sched.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "name", nargs="?", choices=[*get_args(ScheduleName), AUTO], help="a built-in schedule, or 'auto'"
    )
    source.add_argument("--file", type=Path, help="a schedule in text form ('rank 0: 0F0 0F1 0B0 ...')")
    sched.add_argument(
        "--stages", type=args.positive_int, default=None, help="stages (ranks x virtual stages; default 4)"
    )
    sched.add_argument("--microbatches", type=args.positive_int, default=None, help="micro-batches per step (8)")
    sched.add_argument("--virtual", type=args.positive_int, default=None, help="stages per rank (interleaved; 1)")
    times = "; one number, or one per stage, comma-separated"
    sched.add_argument("--forward", type=args.floats, default=[1.0], help="time of one forward" + times)
    sched.add_argument("--backward", type=args.floats, default=None, help="time of one backward (2x forward)" + times)
    sched.add_argument("--input-grad", type=args.floats, default=None, help="time of I (half of backward)" + times)
    sched.add_argument("--weight-grad", type=args.floats, default=None, help="time of W (the rest)" + times)
    sched.add_argument(
        "--limit", type=args.positive_int, default=None, help="auto: micro-batches in flight per rank at most (none)"
    )
    sched.add_argument("--save", type=Path, default=None, help="write the schedule's text here (Schedule.load)")
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
    if ns.limit is not None and ns.name != AUTO:
        raise ValueError("--limit bounds a synthesised schedule's micro-batches in flight: use it with 'auto'")
    stages = schedule.n_stages if ns.file is not None else ns.stages or 4
    costs = StageCosts.of(
        stages,
        forward=args.per_stage(ns.forward, stages, "forward") or 1.0,
        backward=args.per_stage(ns.backward, stages, "backward"),
        input_grad=args.per_stage(ns.input_grad, stages, "input-grad"),
        weight_grad=args.per_stage(ns.weight_grad, stages, "weight-grad"),
        transfer=ns.transfer,
    )
    if ns.name == AUTO:
        virtual = ns.virtual or 1
        if stages % virtual:
            raise ValueError(f"--stages {stages} is not a multiple of --virtual {virtual}; give a multiple")
        found = synthesise(costs, stages // virtual, ns.microbatches or 8, limit=ns.limit)
        schedule = found.schedule
        if found.builtin_step_time is not None:
            speedup = found.builtin_step_time / found.step_time
            print(f"best built-in within the limit: {found.builtin}, step {found.builtin_step_time:g} ({speedup:.3f}x)")
    elif ns.file is None:
        schedule = build_schedule(ns.name, stages, ns.microbatches or 8, n_virtual=ns.virtual or 1)
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
    if ns.save is not None:
        ns.save.write_text(schedule.to_text())
        print(f"wrote {ns.save}")
    return 0
