"""Which wire carries a transport's messages: shared memory between the ranks of one host, or a process group.

A dedicated transport (``dedicated=True``, gloo) first makes a process group
of its own over its ranks, collectively (every rank of the default group must
construct it, in the same order). On the CPU, where its ranks share memory
(one host, and ``/dev/shm`` visible to all), it then carries its messages
through shared memory (:class:`~stagewise.comm.shared_memory.SharedMemoryWire`):
the same protocol, with no gloo threads or sockets in the way.
``shared_memory`` None does so where it can (unless the environment variable
``STAGEWISE_SHARED_MEMORY`` is ``0``), True insists, False keeps the process
group. Elsewhere the messages travel over the process group
(:class:`~stagewise.comm.process_group_wire.ProcessGroupWire`), with a group of
its own per stream where the backend is not gloo (NCCL ignores tags), or with
``separate_streams=True``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from stagewise.comm.process_group_wire import ProcessGroupWire
from stagewise.comm.shared_memory_connect import connect_shared_memory
from stagewise.comm.wire import Wire

SHARED_MEMORY_VARIABLE = "STAGEWISE_SHARED_MEMORY"
"""The environment variable that, set to ``0``, keeps a transport that may choose (``shared_memory=None``) on gloo."""


@dataclass(frozen=True)
class ChosenWire:
    """What carries a transport's messages."""

    group: dist.ProcessGroup | None
    """The transport's process group: one of its own when dedicated over gloo, else the one it was given."""
    wire: Wire
    standing: bool
    """Steady streams drop their control words (gloo, on a group of the transport's own)."""


def choose_wire(
    group: dist.ProcessGroup | None,
    *,
    rank: int,
    device: torch.device,
    dedicated: bool,
    streams: int,
    separate_streams: bool | None,
    shared_memory: bool | None,
    timeout: float,
) -> ChosenWire:
    """The wire of a transport over ``group`` (None: the default group) on ``device``; collective where it makes
    a group of its own or connects shared memory."""
    backend = dist.get_backend(group)
    standing = dedicated and backend == "gloo"
    eligible = standing and device.type == "cpu"  # what the shared-memory wire can stand in for
    if shared_memory and not eligible:
        raise ValueError(
            f"shared_memory=True needs a dedicated transport on the CPU over gloo; this one is "
            f"dedicated={dedicated} on {device} over {backend}"
        )
    if standing:
        ranks = None if group is None else dist.get_process_group_ranks(group)
        group = dist.new_group(ranks, timeout=timedelta(seconds=timeout), backend="gloo")
    wanted = os.environ.get(SHARED_MEMORY_VARIABLE, "1") != "0" if shared_memory is None else shared_memory
    shared = _shared_memory(group, rank, insist=bool(shared_memory)) if eligible and wanted else None
    wire: Wire = (
        shared
        if shared is not None
        else ProcessGroupWire(group, streams=streams, separate=separate_streams, timeout=timeout)
    )
    return ChosenWire(group, wire, standing)


def _shared_memory(group: dist.ProcessGroup | None, rank: int, *, insist: bool) -> Wire | None:
    """A shared-memory wire over the transport's own group (collective), or None where some rank cannot reach
    the others' shared memory (an error when ``insist``)."""
    assert group is not None
    wire = connect_shared_memory(group, rank)
    if wire is None and insist:
        dist.destroy_process_group(group)
        raise RuntimeError(
            f"rank {rank}: shared_memory=True, but not every rank of the transport can reach the "
            "others' shared memory (other hosts, or containers that do not share /dev/shm); pass "
            "shared_memory=None to fall back to gloo"
        )
    return wire
