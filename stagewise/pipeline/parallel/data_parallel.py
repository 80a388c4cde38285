"""Data parallelism across the replicas of each stage: torch's DistributedDataParallel, synchronised once per step."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from contextlib import AbstractContextManager

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from stagewise.comm.errors import named_collective
from stagewise.pipeline.config import DataParallel
from stagewise.pipeline.stage.module import StageModule
from stagewise.schedule.actions import Action, Kind

log = logging.getLogger(__name__)


def sync_points(actions: Sequence[Action]) -> set[int]:
    """Indices of the actions after which each stage's gradients are complete for the step.

    That is each stage's last B, or its last W where the backward is split
    (I leaves the parameters' gradients to W).
    """
    last: dict[int, int] = {}
    for i, action in enumerate(actions):
        if action.kind in (Kind.B, Kind.W):
            last[action.stage] = i
    return set(last.values())


class Replicas:
    """This rank's stages, each wrapped in DistributedDataParallel over the stage's data-parallel group.

    The executor runs every forward and backward on the stage modules
    themselves, which DDP shares, so gradients accumulate locally across
    micro-batches. Just before the backward that completes a stage's
    gradients for the step (see :func:`sync_points`), :meth:`prepare` arms
    DDP's reducer, which then all-reduces the accumulated gradients bucket by
    bucket while that backward runs, and averages them over the replicas.
    That is once per step, not once per micro-batch. It is the mechanism
    ``torch.distributed.pipelining`` uses for DDP too (``Reducer.prepare_for_backward``),
    since a pipeline's forwards and backwards of different micro-batches
    interleave and DDP's ``no_sync`` cannot express "sync on the last backward".

    DDP copies replica 0's parameters and buffers to the others when it wraps
    a stage; after that, each replica keeps its own buffers (running
    statistics), since buffers are synchronised only by DDP's forward. DDP's
    ``static_graph`` is not offered: its first-step bookkeeping hangs on DDP's
    own forward, which stages do not run through, so it would change nothing.
    """

    def __init__(
        self,
        stages: dict[int, StageModule],
        *,
        group: dist.ProcessGroup,
        device: torch.device,
        config: DataParallel,
        timeout: float,
        ignored: set[nn.Parameter] | None = None,
    ) -> None:
        self.config = config
        self.group = group
        self.timeout = timeout
        """Seconds DDP's all-reduce may wait (the group's own bound), for :meth:`failed`'s message."""
        self.wrapped: dict[int, DistributedDataParallel] = {}
        for s, module in stages.items():
            if not any(p.requires_grad for p in module.parameters()):
                continue  # nothing to synchronise; DDP refuses such modules
            if ignored:  # split experts: their gradients are summed over the ranks holding the same experts
                skipped = {id(p) for p in ignored}
                names = [name for name, p in module.named_parameters() if id(p) in skipped]
                DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(module, names)  # type: ignore[no-untyped-call]
            ddp = DistributedDataParallel(
                module,
                device_ids=[device.index] if device.type == "cuda" else None,
                process_group=group,
                bucket_cap_mb=config.bucket_cap_mb,
                gradient_as_bucket_view=config.gradient_as_bucket_view,
                find_unused_parameters=config.find_unused_parameters,
            )
            if config.comm_hook is not None:
                state = config.comm_state if config.comm_state is not None else group
                ddp.register_comm_hook(state, config.comm_hook)
            self.wrapped[s] = ddp
        log.info("stages %s synchronise gradients with DDP over %d replicas", list(self.wrapped), group.size())

    def prepare(self, stage: int, outputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Arm the reducer of ``stage`` for the backward from ``outputs``, which then all-reduces the gradients.

        Returns the roots to add to that backward: none, unless it reaches none of the stage's parameters (this
        micro-batch used none of them, or nothing in it needs a gradient). Then DDP's hooks would not fire,
        and the gradients that earlier micro-batches accumulated would stay unsynchronised (with
        ``find_unused_parameters``: silently). The added root is zero and reads one parameter (with
        ``find_unused_parameters``, one that already has a gradient where one does) or every parameter (without,
        as DDP then waits for each); its backward adds zero to their gradients (a zero gradient where one was
        None), and the replicas all-reduce what they accumulated.
        """
        ddp = self.wrapped.get(stage)
        if ddp is None:
            return []
        trained = [p for p in ddp.module.parameters() if p.requires_grad]
        extra: list[torch.Tensor] = []
        if not reaches(outputs, trained):
            if self.config.find_unused_parameters:
                trained = [next((p for p in trained if p.grad is not None), trained[0])]
            terms = [p.flatten()[:1].sum() for p in trained]  # one element each (none of an empty one)
            extra = [sum(terms[1:], terms[0]) * 0.0]
        ddp.reducer.prepare_for_backward([*outputs, *extra] if self.config.find_unused_parameters else [])
        return extra

    def synchronising(self, stage: int, action: Action) -> AbstractContextManager[None]:
        """Around the backward of ``action``, in which DDP all-reduces ``stage``'s gradients: when that
        all-reduce times out or loses a replica, a named :class:`~stagewise.comm.CommError`."""
        rank = dist.get_rank()
        peer = next((r for r in dist.get_process_group_ranks(self.group) if r != rank), rank)
        what = f"DDP's all-reduce of stage {stage}'s gradients over its replicas, in {action}"
        return named_collective(rank=rank, peer=peer, what=what, timeout=self.timeout)


def reaches(outputs: Sequence[torch.Tensor], params: Sequence[torch.Tensor]) -> bool:
    """Whether a backward from ``outputs`` reaches any of ``params``: a walk of their autograd graph."""
    targets = {id(p) for p in params}
    stack = [t.grad_fn for t in outputs if t.grad_fn is not None]
    if any(id(t) in targets for t in outputs if t.requires_grad and t.grad_fn is None):
        return True
    seen = set(stack)
    while stack:
        node = stack.pop()
        if id(getattr(node, "variable", None)) in targets:  # an AccumulateGrad node: a leaf's gradient
            return True
        for following, _ in node.next_functions:
            if following is not None and following not in seen:
                seen.add(following)
                stack.append(following)
    return False
