"""The tensor-parallel plan of stagewise's GPT: which modules of each layer split over ``tp`` ranks, and how."""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from stagewise.models.gpt import Block, Embedding, MoEBlock


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


def moe_block_plan(block: MoEBlock, tp: int) -> dict[str, ParallelStyle]:
    """A mixture-of-experts block's split: the attention's heads as in :func:`block_plan`, and the shared experts'
    hidden units (``gate`` and ``up`` by columns, ``down`` by rows). The router and the routed experts stay whole on
    every tp rank, which routes the same tokens: expert parallelism (``ep``) splits the experts."""
    shared = block.moe.shared
    hidden = shared.gate.out_features if shared is not None else tp
    if block.n_heads % tp or hidden % tp:
        fits = sorted(set(_divisors(block.n_heads)) & set(_divisors(hidden)))
        raise ValueError(
            f"tp={tp} does not divide the {block.n_heads} attention heads and the shared experts' {hidden} hidden "
            f"units of a mixture-of-experts block; choose tp among {fits}"
        )
    styles: dict[str, ParallelStyle] = {"qkv": ColwiseParallel(), "proj": RowwiseParallel()}
    if shared is not None:
        styles |= {"moe.shared.gate": ColwiseParallel(), "moe.shared.up": ColwiseParallel()}
        styles["moe.shared.down"] = RowwiseParallel()
    return styles


def _vocabulary(rows: int, tp: int) -> None:
    if rows % tp:
        raise ValueError(
            f"tp={tp} does not divide the vocabulary of {rows} tokens, which the token embedding and the LM head "
            f"split; choose tp among {_divisors(rows)}, or pad the vocabulary to a multiple of {tp}"
        )


def plan(name: str, module: nn.Module, tp: int) -> Mapping[str, ParallelStyle] | ParallelStyle | None:
    """A :data:`~stagewise.pipeline.TensorParallelPlan` for :class:`~stagewise.models.gpt.GPT`.

    Blocks split as :func:`block_plan` says (mixture-of-experts blocks as :func:`moe_block_plan`). The vocabulary
    is split too: the token embedding's rows (each rank looks up the ids in its rows, and the embeddings are
    all-reduced) and the LM head's (each rank computes its share of the logits, all-gathered into every logit, so
    the loss is the model's own: no vocabulary-parallel cross-entropy). A tied embedding and head are split alike,
    so they stay one matrix. The position table and the final norm stay whole on every rank.
    """
    if isinstance(module, Block):
        return block_plan(module, tp)
    if isinstance(module, MoEBlock):
        return moe_block_plan(module, tp)
    if isinstance(module, Embedding):
        _vocabulary(module.tokens.num_embeddings, tp)
        return {"tokens": RowwiseParallel(input_layouts=Replicate())}
    if name == "head" and isinstance(module, nn.Linear):
        _vocabulary(module.out_features, tp)
        return ColwiseParallel(output_layouts=Replicate())
    return None
