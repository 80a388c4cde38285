"""share_loss() and share_count(): what every rank of a pipeline learns from the one rank that knows it."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from stagewise.comm import PipelineMesh, named_collective
from stagewise.pipeline.hybrid import combine_losses


@dataclass(frozen=True)
class SharedLoss:
    """The global batch's loss as every rank of a pipeline learns it."""

    loss: torch.Tensor
    """The loss over all replicas (float32, 0-dim)."""
    bad_microbatch: int
    """This replica's first micro-batch whose loss was not finite, or -1."""


def share_loss(
    loss: torch.Tensor | None,
    samples: int,
    *,
    mesh: PipelineMesh,
    last: int,
    replicated: bool,
    mean: bool,
    bad_microbatch: int = -1,
    training: bool = True,
) -> SharedLoss:
    """The global batch's loss on every rank: combined over the replicas, then sent along the pipeline.

    ``loss`` and ``samples`` are this rank's (None and 0 off the last stage);
    ``last`` is the global rank of this replica's last stage, ``replicated``
    whether there are replicas to combine, and ``mean`` whether the loss is a
    mean, which weights each replica's by its samples. ``bad_microbatch``
    travels along from the last stage. With ``training``, replicas whose
    batches differ in size are refused: DDP would average their gradients
    with equal weights.
    """
    device = mesh.device
    loss = (loss if loss is not None else torch.zeros((), device=device)).detach().to(device, torch.float32)
    smallest = largest = 0
    seconds = mesh.timeout.total_seconds()
    if mesh.rank == last and replicated:
        group = mesh.dp_group
        peer = next(r for r in dist.get_process_group_ranks(group) if r != mesh.rank)
        with named_collective(
            rank=mesh.rank, peer=peer, what="the all-gather of the replicas' losses", timeout=seconds
        ):
            whole = combine_losses(loss, samples, group=group, mean=mean)
        loss, smallest, largest = whole.loss, whole.smallest, whole.largest
    packet = torch.tensor([float(loss), smallest, largest, bad_microbatch], dtype=torch.float64, device=device)
    what = f"the broadcast of the loss from rank {last}, the last stage's, along the pipeline"
    with named_collective(rank=mesh.rank, peer=last, what=what, timeout=seconds):
        dist.broadcast(packet, src=last, group=mesh.pp_group)
    smallest, largest = int(packet[1]), int(packet[2])
    if training and mean and smallest != largest:
        raise ValueError(
            f"the replicas' batches differ in size ({smallest} to {largest} samples), but DDP averages their "
            "gradients with equal weights, so this step's gradients are not the global batch's mean; give "
            "every replica the same number of samples (stagewise.pipeline.StageLoader does)"
        )
    return SharedLoss(packet[0].to(torch.float32), int(packet[3]))


def share_count(count: int, *, mesh: PipelineMesh, first: int) -> int:
    """``count`` as the rank ``first`` (this replica's first stage) has it, on every rank of the pipeline."""
    if mesh.layout.pp == 1:
        return count
    packet = torch.tensor([count], dtype=torch.int64, device=mesh.device)
    what = f"the broadcast of the micro-batch count from rank {first}, the first stage's, along the pipeline"
    with named_collective(rank=mesh.rank, peer=first, what=what, timeout=mesh.timeout.total_seconds()):
        dist.broadcast(packet, src=first, group=mesh.pp_group)
    return int(packet.item())
