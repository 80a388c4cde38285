"""The mixture-of-experts layers' part in a step: the batch their load-balancing loss is a mean over, that loss
added to the loss reported, and the load that moves their routing biases (:class:`Routed`).

A layer's balance loss joins the backward by itself (its gradient rides on the layer's output), weighted by
``1 / batch rows``: each micro-batch's share of its batch's mean, as the language-model loss's micro-batches are
weighed. Its value is only reported: summed here over the stages, the layers and the batch's shares."""

from __future__ import annotations

from collections.abc import Iterable
from contextlib import AbstractContextManager
from typing import Any, Protocol, runtime_checkable

import torch
import torch.distributed as dist
from torch import nn

from stagewise.comm import PipelineMesh
from stagewise.comm.errors import named_collective


@runtime_checkable
class Routed(Protocol):
    """What the pipeline needs of a mixture-of-experts layer (see :class:`stagewise.models.moe.MoE`)."""

    num_experts: int
    experts: nn.Module
    """The experts, their parameters stacked on dim 0 (one row per expert); called as
    ``experts(tokens, counts)`` on tokens grouped by local expert."""
    dispatch: Any
    """``dispatch(tokens, counts, experts)``: tokens sorted by expert to their outputs (replaced here)."""
    batch_rows: int | None
    """The rows of the batch a micro-batch belongs to, which the layer's auxiliary loss is divided by."""

    def take_auxiliary_loss(self) -> Any:
        """The auxiliary loss seen since the last call (``.total``: summed over sequences), and a fresh start."""
        ...

    def take_load(self) -> torch.Tensor:
        """The tokens routed to each expert since the last call, and a fresh start."""
        ...

    def balance(self, load: torch.Tensor) -> None:
        """Move the routing towards balance given the whole batch's ``load``."""
        ...


def routed_layers(modules: Iterable[nn.Module]) -> list[Routed]:
    """The mixture-of-experts layers inside ``modules``, in module order."""
    return [sub for module in modules for sub in module.modules() if isinstance(sub, Routed)]


class RoutingLosses:
    """This rank's mixture-of-experts ``layers`` during steps; ``present``: whether the model has any (on any
    rank), so that every rank joins the collectives that sum their losses."""

    def __init__(self, layers: list[Routed], mesh: PipelineMesh, *, present: bool) -> None:
        self.layers = layers
        self.mesh = mesh
        self.present = present
        self.rows = 0

    def begin(self, rows: int) -> None:
        """A step over a batch of ``rows`` sequences on this replica: what each layer's balance loss is divided
        by; what earlier forwards left (an evaluation's) is dropped."""
        self.rows = rows
        for layer in self.layers:
            layer.batch_rows = rows
            layer.take_auxiliary_loss()
            layer.take_load()

    def finish(self) -> torch.Tensor:
        """After a step's backward: the balance loss of the global batch (summed over layers, a mean over
        sequences), on every rank; and each layer's routing moved by the global batch's load."""
        layout, device = self.mesh.layout, self.mesh.device
        total = torch.zeros((), dtype=torch.float64, device=device)
        for layer in self.layers:
            total += layer.take_auxiliary_loss().total.to(device)
        # Every rank adds its share: its layers' sum over its sequences, over the global batch's sequences, and
        # once per tp rank (the tp ranks of a stage compute the same).
        total /= max(1, self.rows) * layout.batch_shards * layout.tp
        if layout.world_size > 1:
            with self._named("the all-reduce of the load-balancing loss", dist.group.WORLD):
                dist.all_reduce(total)
        self._balance()
        return total.to(torch.float32)

    def _balance(self) -> None:
        """Sum each layer's load over the batch's shares and move its routing bias by it."""
        if not self.layers:
            return
        loads = [layer.take_load().to(self.mesh.device) for layer in self.layers]
        flat = torch.cat(loads)
        if self.mesh.layout.batch_shards > 1:
            with self._named("the all-reduce of the experts' load", self.mesh.batch_group):
                dist.all_reduce(flat, group=self.mesh.batch_group)
        for layer, load in zip(self.layers, torch.split(flat, [len(x) for x in loads]), strict=True):
            layer.balance(load)

    def _named(self, what: str, group: dist.ProcessGroup | None) -> AbstractContextManager[None]:
        rank = dist.get_rank()
        peer = next((r for r in dist.get_process_group_ranks(group) if r != rank), rank)
        return named_collective(rank=rank, peer=peer, what=what, timeout=self.mesh.timeout)
