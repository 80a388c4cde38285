"""Tied weights across stages: a copy of a shared parameter on each rank that uses it, kept equal, gradients summed."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from stagewise.comm import PipelineMesh
from stagewise.comm.errors import named_collective
from stagewise.partition import Layer, Partition
from stagewise.partition.layers import SharedParameter
from stagewise.pipeline.stage.retie import holder
from stagewise.schedule.actions import Schedule

log = logging.getLogger(__name__)


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``tensor``: a sharded DTensor's local shard (a view: writing it writes the DTensor),
    else ``tensor`` itself. Copies sharded by FSDP or tensor parallelism are sharded alike on every stage that
    holds one (the same shape over the same mesh dimensions), so their local shards add up as the whole would."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


@dataclass
class TiedCopy:
    """This rank's copy of a parameter that layers on several ranks of the pipeline use."""

    tie: SharedParameter
    param: nn.Parameter
    group: dist.ProcessGroup
    """This replica's ranks that hold a copy."""
    source: int
    """Global rank holding the first layer that uses it: its value is the initial one."""
    primary: bool
    """Whether this rank is ``source``: it alone counts the parameter in the model's gradient norm."""


class Ties:
    """The parameters this rank shares with other ranks of its pipeline, kept equal.

    Every stage that uses a shared parameter (a tied embedding and LM head)
    materialises its own copy. :meth:`synchronise` sets all copies to the
    value of the first layer that uses it (so training starts as the unsplit
    model does), and :meth:`sum_gradients` adds the copies' gradients after
    each backward, so each copy gets the unsplit model's gradient and the
    optimizer keeps them equal. Ranks whose stages all use a parameter share
    one Parameter and need none of this.
    """

    def __init__(
        self,
        layers: Sequence[Layer],
        shared: Sequence[SharedParameter],
        partition: Partition,
        schedule: Schedule,
        mesh: PipelineMesh,
        *,
        timeout: float,
    ) -> None:
        self.copies: list[TiedCopy] = []
        self.rank = mesh.rank
        self.device = mesh.device
        """Where the sums are taken: the backend's device (a gradient offloaded to host memory goes there and back)."""
        self.timeout = timeout
        """Seconds each synchronisation may wait for the other copies' ranks."""
        self.shared = list(shared)
        """What :func:`stagewise.partition.shared_parameters` found before the layers were materialised."""
        held = {s for s in range(schedule.n_stages) if schedule.rank_of(s) == mesh.stage}
        for tie in self.shared:
            positions = [schedule.rank_of(partition.stage_of(i)) for i in tie.indices]
            ordered = list(dict.fromkeys(positions))  # the first holder's position first
            if len(ordered) < 2:
                continue
            mine: dist.ProcessGroup | None = None
            source = -1
            for line in range(mesh.layout.lines):  # every rank creates every group, in the same order
                ranks = [mesh.layout.at(p, line) for p in ordered]
                group = dist.new_group(sorted(ranks), timeout=timedelta(seconds=timeout))
                if line == mesh.line:
                    mine, source = group, ranks[0]
            k = next((k for k, i in enumerate(tie.indices) if partition.stage_of(i) in held), None)
            if k is None or mine is None:
                continue
            module, leaf = holder(layers, tie, k)
            self.copies.append(TiedCopy(tie, getattr(module, leaf), mine, source, source == mesh.rank))
        if self.copies:
            log.info("rank %d keeps copies of tied parameters %s", mesh.rank, [c.tie.names for c in self.copies])

    def close(self) -> None:
        """Destroy the process groups of this rank's tied copies."""
        for copy in self.copies:
            dist.destroy_process_group(copy.group)
        self.copies = []

    def synchronise(self) -> None:
        """Give every copy the value of the first layer that uses it."""
        with torch.no_grad():
            for copy in self.copies:
                what = f"the broadcast of tied parameter {copy.tie.names[0]!r}'s initial value"
                with named_collective(rank=self.rank, peer=copy.source, what=what, timeout=self.timeout):
                    dist.broadcast(local(copy.param.data), src=copy.source, group=copy.group)

    def set_aside(self) -> list[torch.Tensor | None]:
        """Copy the copies' gradients from before a step, for :meth:`sum_gradients` to leave out of the sum.

        A copy, not the tensor: the step accumulates into ``.grad`` in place
        (and under DDP's ``gradient_as_bucket_view`` the tensor is a view of a
        bucket that DDP overwrites).
        """
        return [None if copy.param.grad is None else copy.param.grad.detach().clone() for copy in self.copies]

    def sum_gradients(self, before: Sequence[torch.Tensor | None] = ()) -> None:
        """Add the gradients of all copies of each shared parameter, on every rank that holds one.

        ``before``: what :meth:`set_aside` copied before the step. Every copy
        already held that same total, so it is taken out before the sum and
        added back after it, not summed again.
        """
        for i, copy in enumerate(self.copies):
            param = copy.param
            if not param.requires_grad:  # frozen: no copy has a gradient, and none may get one
                continue
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            earlier = before[i] if i < len(before) else None
            if earlier is not None:
                param.grad.sub_(earlier)
            what = f"the sum of the gradients of tied parameter {copy.tie.names[0]!r}'s copies"
            grad = local(param.grad)
            summed = grad.to(self.device)  # itself where it is on the backend's device already
            with named_collective(rank=self.rank, peer=copy.source, what=what, timeout=self.timeout):
                dist.all_reduce(summed, group=copy.group)
            if summed is not grad:
                grad.copy_(summed)
            if earlier is not None:
                param.grad.add_(earlier)

    def counted(self, param: nn.Parameter) -> bool:
        """False for a copy whose gradient another rank counts in the model's norm."""
        return all(c.primary or c.param is not param for c in self.copies)
