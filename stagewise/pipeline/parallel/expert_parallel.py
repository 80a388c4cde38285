"""Expert parallelism: each mixture-of-experts layer's experts split over the mesh's ``ep`` ranks, its tokens taken
to them and back by all-to-all with uneven splits, their gradients summed over the ranks holding the same experts.

A layer is a mixture of experts when it has what :class:`Routed` names (:class:`stagewise.models.moe.MoE` has it):
the pipeline knows such layers by their attributes, not by their class, so any model may bring its own. Its
experts' parameters are stacked on dim 0, one row per expert; split, each becomes a DTensor sharded on dim 0 over
the ``ep`` mesh, so checkpoints save and load them whole under any ``ep`` (DCP reshards them), clipping counts each
expert once, and exporting gathers them. FSDP and DDP leave them alone: they are split already, and their
gradients, which the all-to-all's backward brings from every rank of the ``ep`` group, are summed here over the
groups that hold the same experts and divided as DDP and FSDP divide the others'.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from stagewise.comm.errors import named_collective
from stagewise.comm.mesh import ExpertGroups, PipelineMesh
from stagewise.pipeline.loss.routing import Routed
from stagewise.pipeline.stage.module import StageModule

log = logging.getLogger(__name__)


class _Exchange(torch.autograd.Function):
    """Rows to the ranks of a group and back by all-to-all with uneven splits; the backward runs the reverse
    exchange over a group of its own, so that a backward beside a forward keeps each group's collectives in order."""

    @staticmethod
    def forward(
        ctx: Any, tokens: torch.Tensor, receive: list[int], send: list[int], route: _Route, what: str
    ) -> torch.Tensor:
        ctx.receive, ctx.send, ctx.route, ctx.what = receive, send, route, what
        return route.exchange(tokens, receive, send, route.forward, what)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None, None]:
        back = ctx.route.exchange(grad, ctx.send, ctx.receive, ctx.route.backward, f"{ctx.what}' gradients")
        return back, None, None, None, None


@dataclass(frozen=True)
class _Route:
    """The groups a layer's all-to-alls run over, and how their failures are named."""

    forward: dist.ProcessGroup
    backward: dist.ProcessGroup
    layer: str
    timeout: float

    def exchange(
        self, tokens: torch.Tensor, receive: list[int], send: list[int], group: dist.ProcessGroup, what: str
    ) -> torch.Tensor:
        out = tokens.new_empty(sum(receive), *tokens.shape[1:])
        with self.named(group, what):
            dist.all_to_all_single(out, tokens.contiguous(), receive, send, group=group)
        return out

    def named(self, group: dist.ProcessGroup, what: str) -> AbstractContextManager[None]:
        rank = dist.get_rank()
        peer = next((r for r in dist.get_process_group_ranks(group) if r != rank), rank)
        return named_collective(
            rank=rank, peer=peer, what=f"the all-to-all of {self.layer}'s {what}", timeout=self.timeout
        )


class AllToAllDispatch:
    """Tokens to their experts on the ``ep`` ranks of ``groups`` and back, by two all-to-alls with uneven splits
    (their backward runs them reversed, over the backward group). Every rank of the group calls it once per
    forward of the layer."""

    def __init__(self, groups: ExpertGroups, *, layer: str, timeout: float) -> None:
        self.route = _Route(groups.ep, groups.backward, layer, timeout)
        self.ep = groups.ep.size()

    def __call__(self, tokens: torch.Tensor, counts: torch.Tensor, experts: nn.Module) -> torch.Tensor:
        local = counts.numel() // self.ep
        sent = counts.reshape(self.ep, local)  # row j: the tokens for rank j's experts
        got = torch.empty_like(sent)  # row j: the tokens rank j sends for this rank's experts
        with self.route.named(self.route.forward, "token counts"):
            dist.all_to_all_single(got, sent.contiguous(), group=self.route.forward)
        send, receive = sent.sum(1).tolist(), got.sum(1).tolist()
        arrived = _Exchange.apply(tokens, receive, send, self.route, "tokens")  # type: ignore[no-untyped-call]
        # Arrived by (source rank, expert); the experts take theirs together: by (expert, source rank).
        blocks = torch.split(arrived, got.flatten().tolist())
        by_expert = [j * local + e for e in range(local) for j in range(self.ep)]
        computed = experts(torch.cat([blocks[i] for i in by_expert]), got.sum(0).tolist())
        done = torch.split(computed, [blocks[i].shape[0] for i in by_expert])
        back: list[torch.Tensor] = [done[0]] * len(done)
        for position, i in enumerate(by_expert):
            back[i] = done[position]
        out: torch.Tensor = _Exchange.apply(torch.cat(back), send, receive, self.route, "outputs")  # type: ignore[no-untyped-call]
        return out


class ExpertParallel:
    """This rank's stages' mixture-of-experts layers with their experts split over ``ep`` ranks (see the module's
    docstring); :meth:`synchronise` sums the experts' gradients once per step."""

    def __init__(self, stages: Mapping[int, StageModule], groups: ExpertGroups, *, data_ranks: int, timeout: float):
        self.groups = groups
        self.data_ranks = data_ranks
        """The ranks of a stage that take their own shares of the batch (``dp x fsdp``): what each gradient is
        divided by, as DDP and FSDP divide the others' (their average over the batch's shares)."""
        self.timeout = timeout
        self.parameters: list[nn.Parameter] = []
        ep, index = groups.mesh.size(), groups.mesh.get_local_rank()
        for stage in stages.values():
            for name, layer in _named_routed(stage):
                if layer.num_experts % ep:
                    raise ValueError(
                        f"{name} has {layer.num_experts} experts, which ep={ep} ranks cannot split evenly; choose "
                        f"ep among the divisors of {layer.num_experts}, or a model with a multiple of {ep} experts"
                    )
                self.parameters += _split(layer.experts, groups, index, ep)
                layer.dispatch = AllToAllDispatch(groups, layer=name, timeout=timeout)
        log.info("%d expert tensors are split over %d ep ranks", len(self.parameters), ep)

    def synchronise(self) -> None:
        """Sum each expert gradient over the ranks holding the same experts, divided by :attr:`data_ranks`."""
        grads = [p.grad.to_local() for p in self.parameters if isinstance(p.grad, DTensor)]
        if not grads:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        if self.groups.replicas.size() > 1:
            rank = dist.get_rank()
            peer = next(r for r in dist.get_process_group_ranks(self.groups.replicas) if r != rank)
            what = "the all-reduce of the experts' gradients"
            with named_collective(rank=rank, peer=peer, what=what, timeout=self.timeout):
                dist.all_reduce(flat, group=self.groups.replicas)
        flat /= self.data_ranks
        offset = 0
        for grad in grads:
            grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
            offset += grad.numel()


def _named_routed(stage: StageModule) -> list[tuple[str, Routed]]:
    return [
        (f"{layer_name}.{sub_name}".rstrip("."), sub)
        for layer_name, layer in zip(stage.names, stage.layers, strict=True)
        for sub_name, sub in layer.named_modules()
        if isinstance(sub, Routed)
    ]


def _split(experts: nn.Module, groups: ExpertGroups, index: int, ep: int) -> list[nn.Parameter]:
    """Replace each stacked parameter of ``experts`` by its rows for ep rank ``index``, a DTensor sharded on dim 0."""
    made = []
    for name, whole in list(experts.named_parameters(recurse=False)):
        rows = whole.detach().chunk(ep)[index].clone()
        split = DTensor.from_local(
            rows, groups.mesh, [Shard(0)], run_check=False, shape=whole.shape, stride=whole.stride()
        )
        param = nn.Parameter(split, requires_grad=whole.requires_grad)
        setattr(experts, name, param)
        made.append(param)
    return made


def expert_parallel(stages: Mapping[int, StageModule], mesh: PipelineMesh) -> ExpertParallel | None:
    """Split the experts of ``stages`` over ``mesh``'s ``ep`` ranks; None with ``ep = 1`` (every expert here)."""
    if mesh.experts is None:
        return None
    return ExpertParallel(stages, mesh.experts, data_ranks=mesh.layout.batch_shards, timeout=mesh.timeout)
