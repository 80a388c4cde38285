"""Token-mean losses: the valid target tokens of the global batch, by which each micro-batch's summed loss is divided.

With ``Loss(reduction="tokens")``, ``loss_fn`` sums its micro-batch's per-token losses and the pipeline divides each
sum by the number of targets other than ``ignore_index`` in the whole global batch (every micro-batch of every
replica): the loss a padded language-model batch has in Hugging Face's trainers, the mean over its valid tokens.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from stagewise.comm import PipelineMesh
from stagewise.comm.errors import named_collective
from stagewise.comm.payload import Payload, as_tensors
from stagewise.pipeline.loss.microbatch import Microbatches


def valid_tokens(targets: Payload, ignore_index: int, *, shift_labels: bool = False) -> int:
    """The entries of ``targets`` (of its first tensor, for a tuple) other than ``ignore_index``; with
    ``shift_labels`` (Hugging Face's labels, shifted by the loss), those after each sample's first.

    Raises:
        ValueError: the counted tensor does not hold integer class ids.
    """
    counted = as_tensors(targets)[0][0]
    if counted.is_floating_point() or counted.is_complex() or counted.dtype == torch.bool:
        raise ValueError(
            f"Loss(reduction='tokens') counts the targets other than ignore_index={ignore_index} in the first target "
            f"tensor, which must hold integer class ids, but it is {counted.dtype}; pass the class ids (first, "
            "in a tuple of targets) or choose Loss(reduction='mean' or 'sum')"
        )
    if shift_labels:
        if counted.dim() < 2:
            raise ValueError(
                f"shift_labels counts each sample's labels after its first, but the first target tensor has shape "
                f"{tuple(counted.shape)}; give labels shaped [batch, sequence, ...], or set shift_labels=False"
            )
        counted = counted[:, 1:]
    return int((counted != ignore_index).sum().item())


def global_tokens(count: int, *, mesh: PipelineMesh, timeout: float) -> int:
    """``count`` summed over the replicas of this rank's stage (an all-reduce over its batch group, ``dp x fsdp``, which
    every replica's last stage joins); ``count`` itself without replicas. A replica that does not join within
    ``timeout`` seconds (the group's bound) raises a :class:`~stagewise.comm.CommError` naming this all-reduce."""
    if mesh.layout.batch_shards == 1:
        return count
    group = mesh.batch_group
    peer = next(r for r in dist.get_process_group_ranks(group) if r != mesh.rank)
    total = torch.tensor([count], dtype=torch.int64, device=mesh.device)
    what = "the all-reduce of the replicas' valid target tokens"
    with named_collective(rank=mesh.rank, peer=peer, what=what, timeout=timeout):
        dist.all_reduce(total, group=group)
    return int(total.item())


def per_token(parts: Microbatches, tokens: int) -> Microbatches:
    """``parts`` weighted for a token mean: each summed loss divided by ``tokens``, the global batch's valid
    tokens. Without any (``tokens == 0``) every weight is 0, so the step adds nothing to the gradients, and
    :func:`check_tokens` refuses it on every rank once the count has reached them with the loss."""
    weight = 1.0 / tokens if tokens > 0 else 0.0
    return dataclasses.replace(parts, weights=tuple(weight for _ in parts.sizes), tokens=tokens)


def check_tokens(tokens: int, ignore_index: int) -> None:
    """Refuse a global batch without valid target tokens, whose token mean would be 0 / 0.

    Raises:
        ValueError: ``tokens`` is 0.
    """
    if tokens == 0:
        raise ValueError(
            f"the global batch has no valid target tokens (every target is ignore_index={ignore_index}, on every "
            "replica), so its token-mean loss would be 0 / 0; give each step at least one target other than "
            f"{ignore_index}, or check that the padding of the targets uses ignore_index"
        )
