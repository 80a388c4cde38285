"""Zero-bubble's W starts from the ops that read each parameter (``ParameterUses``): an op that hands the parameter
back itself (``w.to(w.dtype)``, ``w.contiguous()``) reads nothing, and W must not start there too."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from stagewise.pipeline.backward.gradients import grad_tensors
from stagewise.pipeline.backward.split import ParameterUses, weight_gradients


class SameDtype(nn.Module):
    """A linear layer whose weight goes through ``.to(x.dtype)`` and ``.contiguous()``, which return it unchanged,
    then is read twice (a module that mixes precisions where they differ)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight.to(x.dtype).contiguous()
        return torch.tanh(F.linear(x, w)) + F.linear(x, w * 2)


@pytest.mark.parametrize("joint", [False, True])
def test_an_op_that_hands_back_the_parameter_is_not_where_w_starts(joint: bool) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(SameDtype(), nn.Linear(4, 2))
    x = torch.randn(3, 4)
    model(x).square().sum().backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    uses: list = []  # type: ignore[type-arg]
    recorder = ParameterUses(model.parameters(), uses)
    recorder.cut_all = joint
    with recorder:
        loss = model(x).square().sum()
    assert all(all(t is not p for p in use.params for t in grad_tensors(use.output)) for use in uses)
    outputs = [grad_tensors(use.output) for use in uses]
    got = iter(torch.autograd.grad([loss], [t for group in outputs for t in group], retain_graph=True))  # I
    weight_gradients(uses, [[next(got) for _ in group] for group in outputs], joint=joint)  # W
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, want[name], msg=name)
