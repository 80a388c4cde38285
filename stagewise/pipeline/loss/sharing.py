"""share_loss() and share_count(): what every rank of a pipeline learns from the one rank that knows it."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from stagewise.comm import PipelineMesh, Transport
from stagewise.comm.errors import named_collective


@dataclass(frozen=True)
class SharedLoss:
    """The global batch's loss as every rank of a pipeline learns it."""

    loss: torch.Tensor
    """The loss over all replicas (float32, 0-dim)."""
    bad_microbatch: int
    """This replica's first micro-batch whose loss was not finite, or -1."""
    tokens: int
    """For a token mean, the global batch's valid target tokens, as the last stage counted them; else -1."""


@dataclass(frozen=True)
class Sharing:
    """How the ranks of one replica's pipeline tell each other what one of them knows, and how long they wait."""

    mesh: PipelineMesh
    transport: Transport
    """The pipeline's transport, which carries the message where it can (see :func:`along_pipeline`)."""
    timeout: float
    """Seconds each wait may last: the pipeline's one timeout (the transport's too)."""


def share_loss(
    loss: torch.Tensor | None,
    samples: int,
    *,
    sharing: Sharing,
    last: int,
    mean: bool,
    bad_microbatch: int = -1,
    tokens: int = -1,
    training: bool = True,
) -> SharedLoss:
    """The global batch's loss on every rank: combined over the replicas, then sent along the pipeline.

    ``loss`` and ``samples`` are this rank's (None and 0 off the last stage);
    ``last`` is the global rank of this replica's last stage, and ``mean``
    whether the loss is a mean, which weights each replica's by its samples
    when the mesh has replicas (``dp > 1``) to combine; otherwise (a sum, or
    a token mean, already divided by the global count) they are added.
    ``bad_microbatch`` and ``tokens`` (a token mean's global count) travel
    along from the last stage. With ``training`` and ``mean``, replicas whose
    batches differ in size are refused: DDP would average their gradients
    with equal weights. The loss travels as :func:`along_pipeline` sends it;
    every wait is bounded by ``sharing.timeout``.
    """
    mesh = sharing.mesh
    device = mesh.device
    loss = (loss if loss is not None else torch.zeros((), device=device)).detach().to(device, torch.float32)
    smallest = largest = 0
    if mesh.rank == last and mesh.layout.batch_shards > 1:
        group = mesh.batch_group
        peer = next(r for r in dist.get_process_group_ranks(group) if r != mesh.rank)
        what = "the all-gather of the replicas' losses"
        with named_collective(rank=mesh.rank, peer=peer, what=what, timeout=sharing.timeout):
            whole = combine_losses(loss, samples, group=group, mean=mean)
        loss, smallest, largest = whole.loss, whole.smallest, whole.largest
    packet = torch.tensor([float(loss), smallest, largest, bad_microbatch, tokens], dtype=torch.float64, device=device)
    what = f"the loss from rank {last}, the last stage's, sent along the pipeline"
    packet = along_pipeline(packet, last, mesh=mesh, transport=sharing.transport, what=what)
    smallest, largest = int(packet[1]), int(packet[2])
    if training and mean and smallest != largest:
        raise ValueError(
            f"the replicas' batches differ in size ({smallest} to {largest} samples), but DDP averages their "
            "gradients with equal weights, so this step's gradients are not the global batch's mean; give "
            "every replica the same number of samples (stagewise.pipeline.StageLoader does)"
        )
    return SharedLoss(packet[0].to(torch.float32), int(packet[3]), int(packet[4]))


def share_count(count: int, *, sharing: Sharing, first: int) -> int:
    """``count`` as the rank ``first`` (this replica's first stage) has it, on every rank of the pipeline."""
    mesh = sharing.mesh
    packet = torch.tensor([count], dtype=torch.int64, device=mesh.device)
    what = f"the micro-batch count from rank {first}, the first stage's, sent along the pipeline"
    return int(along_pipeline(packet, first, mesh=mesh, transport=sharing.transport, what=what).item())


def along_pipeline(
    packet: torch.Tensor, source: int, *, mesh: PipelineMesh, transport: Transport, what: str
) -> torch.Tensor:
    """``packet`` as rank ``source`` has it, on every rank of this replica's pipeline (in place).

    The transport carries it as its wire does best (:meth:`Transport.broadcast_along`): through shared memory, a
    message from ``source`` to each other rank, which wakes no gloo thread on either side (that cost a small
    pipeline up to 2 ms a step); over a process group, a broadcast over the pipeline's. Either way the wait is
    bounded by the transport's timeout (the pipeline's), and a timeout or a lost peer is named after ``what``.
    """
    if mesh.layout.pp > 1:
        transport.broadcast_along(mesh.pp_group, source, packet, what=what)
    return packet


@dataclass(frozen=True)
class ReplicaLoss:
    """The step's loss over all replicas, and the smallest and largest replica batch."""

    loss: torch.Tensor
    smallest: int
    largest: int


def combine_losses(loss: torch.Tensor, samples: int, *, group: dist.ProcessGroup, mean: bool) -> ReplicaLoss:
    """The global batch's loss from each replica's (on the last stage): weighted by batch size for a mean loss."""
    mine = torch.tensor([float(loss), float(samples)], dtype=torch.float64, device=loss.device)
    every = [torch.empty_like(mine) for _ in range(group.size())]
    dist.all_gather(every, mine, group=group)
    table = torch.stack(every).cpu()
    sizes = table[:, 1]
    total = (table[:, 0] * sizes).sum() / sizes.sum() if mean else table[:, 0].sum()
    return ReplicaLoss(total.to(loss.device, torch.float32), int(sizes.min()), int(sizes.max()))
