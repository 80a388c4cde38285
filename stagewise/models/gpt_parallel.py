"""The tensor-parallel plan of stagewise's GPT: which modules of each layer split over ``tp`` ranks, and how."""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from stagewise.models.gpt import Block


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def block_plan(block: Block, tp: int) -> dict[str, ParallelStyle]:
    """Megatron's split of a GPT block: the attention's heads (``qkv`` by columns, ``proj`` by rows) and the
    MLP's hidden units (``fc`` by columns, ``out`` by rows), so each block all-reduces its activations twice in
    the forward and twice in the backward; its layer norms stay whole on every rank."""
    hidden = block.fc.out_features
    if block.n_heads % tp or hidden % tp:
        fits = sorted(set(_divisors(block.n_heads)) & set(_divisors(hidden)))
        raise ValueError(
            f"tp={tp} does not divide the {block.n_heads} attention heads and the MLP's {hidden} hidden units of "
            f"a GPT block; choose tp among {fits}"
        )
    return {"qkv": ColwiseParallel(), "proj": RowwiseParallel(), "fc": ColwiseParallel(), "out": RowwiseParallel()}


def plan(module: nn.Module, tp: int) -> Mapping[str, ParallelStyle] | None:
    """A :data:`~stagewise.pipeline.tensor_parallel.TensorParallelPlan` for :class:`~stagewise.models.gpt.GPT`:
    blocks split as :func:`block_plan` says; the embedding, the final norm and the LM head stay whole on every
    rank (replicated: the head computes every logit, so the loss needs no vocabulary-parallel cross-entropy, and
    a tied embedding and head stay one matrix)."""
    return block_plan(module, tp) if isinstance(module, Block) else None
