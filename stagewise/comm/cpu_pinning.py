"""CPU pinning of launched processes: each its own equal share of the launcher's CPUs (``pin_cores``)."""

from __future__ import annotations

import os


def usable_cores() -> int:
    """The CPU cores this process may run on: its affinity where the platform has one (Linux), else the machine's."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def cpu_shares(nprocs: int) -> list[frozenset[int]]:
    """The CPUs of each of ``nprocs`` local processes under ``pin_cores``: equal, disjoint runs of ours, in order."""
    if not hasattr(os, "sched_setaffinity"):
        raise ValueError("pin_cores needs os.sched_setaffinity, which this platform lacks (Linux has it)")
    mine = sorted(os.sched_getaffinity(0))
    if nprocs > len(mine):
        raise ValueError(
            f"pin_cores gives each process at least one CPU, but {nprocs} processes share {len(mine)} CPUs "
            f"({mine}); launch at most {len(mine)} or leave pin_cores out"
        )
    each = len(mine) // nprocs
    return [frozenset(mine[r * each : (r + 1) * each]) for r in range(nprocs)]


def pin(cpus: frozenset[int]) -> None:
    """Keep every thread of this process, and any it starts later, on ``cpus``."""
    for task in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(task), cpus)
        except ProcessLookupError:  # a thread that ended meanwhile
            continue
