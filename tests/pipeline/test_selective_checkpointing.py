"""Selective activation checkpointing: a layer's backward recomputes the ops it did not keep, and only those."""

from __future__ import annotations

import functools
from collections import Counter

import pytest
import torch
from support.ops import Counted
from torch.utils.checkpoint import checkpoint

from stagewise.models import GPTConfig
from stagewise.pipeline import Compute, SelectiveCheckpointing
from stagewise.pipeline.stage.recompute import KeptOutputChangedError, recompute_contexts

MM = "aten.addmm.default"
"""A linear with a bias: its forward matmul (the backward's are plain mm)."""


def _backward_ops(keep: bool | SelectiveCheckpointing) -> tuple[Counter[str], torch.Tensor]:
    """The ops one GPT block's backward runs (its recomputation included), and its input's gradient."""
    torch.manual_seed(0)
    block = GPTConfig(vocab_size=16, seq_len=8, d_model=16, n_layers=1, n_heads=2).build().blocks[0]
    x = torch.randn(2, 8, 16, requires_grad=True, generator=torch.Generator().manual_seed(1))
    if keep is False:
        out = block(x)
    else:
        selective = keep if isinstance(keep, SelectiveCheckpointing) else None
        contexts = functools.partial(recompute_contexts, block, selective)
        out = checkpoint(block, x, use_reentrant=False, context_fn=contexts)
    counted = Counted()
    with counted:
        out.square().sum().backward()
    assert x.grad is not None
    return counted.ops, x.grad


def test_selective_checkpointing_recomputes_the_rest_but_not_the_matmuls() -> None:
    kept, kept_grad = _backward_ops(False)
    whole, whole_grad = _backward_ops(True)
    selective, selective_grad = _backward_ops(SelectiveCheckpointing())
    torch.testing.assert_close(selective_grad, kept_grad, atol=0, rtol=0)
    torch.testing.assert_close(whole_grad, kept_grad, atol=0, rtol=0)
    # Whole-layer checkpointing runs the linears' forward matmuls again (three of four: the recomputation stops
    # once it has what the backward needs), selective checkpointing none of them.
    assert whole[MM] - kept[MM] == 3 and selective[MM] == kept[MM] == 0
    # The elementwise ops are recomputed: the GELU's forward runs again in the backward of both.
    assert kept["aten.gelu.default"] == 0 and whole["aten.gelu.default"] == selective["aten.gelu.default"] == 1


def test_a_policy_of_ones_own_chooses_what_is_kept() -> None:
    everything, _ = _backward_ops(SelectiveCheckpointing(keep=lambda op: True))
    kept, _ = _backward_ops(False)
    assert everything[MM] == kept[MM] and everything["aten.gelu.default"] == 0  # nothing recomputed


def test_a_bad_policy_is_refused() -> None:
    with pytest.raises(TypeError, match=r"^SelectiveCheckpointing.keep must be a frozenset of op names"):
        SelectiveCheckpointing(keep={"aten.mm.default"})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"^Compute.activation_checkpointing must be True, False, a SelectiveCheck"):
        Compute(activation_checkpointing="selective")  # type: ignore[arg-type]


def test_every_backward_through_a_selective_checkpoint_recomputes_the_rest_and_reuses_the_matmuls() -> None:
    """A split backward's I and W are two backwards through one graph: each recomputes, neither runs a matmul."""
    torch.manual_seed(0)
    block = GPTConfig(vocab_size=16, seq_len=8, d_model=16, n_layers=1, n_heads=2).build().blocks[0]
    x = torch.randn(2, 8, 16, requires_grad=True)
    contexts = functools.partial(recompute_contexts, block, SelectiveCheckpointing())
    out = checkpoint(block, x, use_reentrant=False, context_fn=contexts)
    want = torch.autograd.grad(block(x).square().sum(), [x, *block.parameters()])
    for _ in range(2):
        counted = Counted()
        with counted:
            got = torch.autograd.grad(out.square().sum(), [x, *block.parameters()], retain_graph=True)
        assert counted.ops[MM] == 0 and counted.ops["aten.gelu.default"] == 1
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, atol=0, rtol=0)


def test_a_kept_output_changed_in_place_is_refused_in_one_line() -> None:
    weight = torch.randn(4, 4, requires_grad=True)

    def layer(x: torch.Tensor) -> torch.Tensor:
        y = x @ weight
        y.add_(1)  # changes the matmul's output, which selective checkpointing kept
        return y.sin()

    contexts = functools.partial(recompute_contexts, torch.nn.Identity(), SelectiveCheckpointing())
    out = checkpoint(layer, torch.randn(2, 4, requires_grad=True), use_reentrant=False, context_fn=contexts)
    with pytest.raises(KeptOutputChangedError, match=r"^selective checkpointing kept the output of aten.mm.default"):
        out.sum().backward()
