"""``stagewise partition``: profile a preset and print its optimal split into pipeline stages."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, get_args

from stagewise.cli import args
from stagewise.cli.commands import COMMANDS
from stagewise.models import PRESETS
from stagewise.partition import By, MemorySetting, balance_costs, layers_of, profile, shared_parameters
from stagewise.run.planned_model import check_seq_len
from stagewise.schedule import ScheduleName, build, holdings
from stagewise.schedule.builders import BUILDERS
from stagewise.units import format_bytes

_ONE_STAGE_PER_RANK = [name for name in get_args(ScheduleName) if not BUILDERS[name].virtual]
"""The built-in schedules that run one stage per rank, as ``--stages`` stages on as many devices."""


def add(commands: Any) -> None:
    part = commands.add_parser(
        "partition",
        help=COMMANDS["partition"].help,
        description="Profile a model layer by layer (on the meta device unless --by time) and print "
        "the split into stages that minimises the slowest stage, within each device's memory.",
    )
    part.add_argument("--model", default="gpt-small", choices=sorted(PRESETS), help="model preset")
    part.add_argument("--stages", type=args.positive_int, default=4, help="number of pipeline stages")
    part.add_argument("--by", default="flops", choices=get_args(By), help="what a stage's load counts")
    part.add_argument("--micro-batch-size", type=args.positive_int, default=1, help="sequences per micro-batch")
    part.add_argument("--seq-len", type=args.positive_int, default=None, help="tokens per sequence (preset's)")
    part.add_argument("--microbatches", type=args.positive_int, default=8, help="micro-batches per step")
    part.add_argument("--schedule", default="1f1b", choices=_ONE_STAGE_PER_RANK, help="for memory")
    part.add_argument("--capacity", type=args.sizes, default=None, help="device memory, e.g. 80GiB, or one per stage")
    part.add_argument("--speeds", type=args.floats, default=None, help="relative device speeds, one per stage")
    part.add_argument("--state-multiplier", type=float, default=4.0, help="parameter copies kept (4: Adam)")
    part.add_argument("--device", type=args.device, default=None, help="where --by time measures (default cpu)")
    part.add_argument("--json", type=Path, default=None, help="also write the partition as JSON here")


def run(ns: argparse.Namespace) -> int:
    config = PRESETS[ns.model]
    timed = ns.by == "time"
    if ns.device is not None and not timed:
        raise ValueError("--device says where --by time measures; add --by time, or leave --device out")
    check_seq_len(ns.seq_len, ns.model, PRESETS[ns.model])
    model = config.build(device="meta")
    sample = config.example(ns.micro_batch_size, ns.seq_len)
    costs = profile(model, sample, time=timed, device=(ns.device or "cpu") if timed else None, progress=timed)
    schedule = build(ns.schedule, ns.stages, ns.microbatches)
    part = balance_costs(
        costs,
        ns.stages,
        by=ns.by,
        speeds=args.per_stage(ns.speeds, ns.stages, "speeds"),
        capacities=args.per_stage(ns.capacity, ns.stages, "capacity"),
        # What the schedule holds, with Pipeline's default weight-gradient pool.
        memory=MemorySetting(schedule, holdings(schedule), ns.state_multiplier),
        shared=shared_parameters(layers_of(model)),  # tied weights: one copy per stage
    )
    total = sum(p.numel() for p in model.parameters())  # a tied parameter once
    shape = "x".join(str(d) for d in sample.shape)
    print(
        f"{ns.model}: {len(costs)} layers, {total:,} parameters; micro-batch of shape {shape}, "
        f"{ns.microbatches} micro-batches, {ns.schedule}; balanced by {ns.by}"
    )
    print(part.report())
    if part.memory is not None:
        print(f"peak stage memory {format_bytes(max(part.memory))} ({ns.schedule}, state x{ns.state_multiplier:g})")
    if ns.json is not None:
        ns.json.write_text(part.to_json() + "\n")
        print(f"wrote {ns.json}")
    return 0
