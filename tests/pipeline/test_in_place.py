"""A stage whose layers change their received input in place runs on a copy, equal to the unsplit model."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from support.chains import mse
from support.in_place import NormThenReLUInPlace
from support.multiproc import run_ranks
from torch import nn

from stagewise.comm import init_mesh
from stagewise.partition import Partition
from stagewise.pipeline import Pipeline, PipelineOptions


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(6, 6), nn.ReLU(inplace=True), nn.Linear(6, 6), NormThenReLUInPlace(6), nn.Linear(6, 2)
    )


BOUNDS = (0, 1, 3, 5)  # stages 1 and 2 begin with a layer that changes its input in place
M = 3


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(8, 6, generator=g), torch.randn(8, 2, generator=g)


def train(schedule: str) -> dict[str, dict[str, torch.Tensor]]:
    torch.set_num_threads(1)
    # The reference moves batch-norm statistics once per micro-batch, and so does this pipeline: the forward that
    # is run again must not move them twice. (test_batch_norm.py checks the retry with the default, once per step.)
    pipe = Pipeline(model(), Partition.from_bounds(BOUNDS), schedule=schedule, n_microbatches=M, loss_fn=mse,  # type: ignore[arg-type]
                    mesh=init_mesh(3, timeout=30), options=PipelineOptions(batch_norm="micro-batch"))  # fmt: skip
    x, y = batch()
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    for _ in range(2):
        opt.zero_grad()
        pipe.step(x, y)
        opt.step()
    grads = {n: p.grad.clone() for n, p in pipe.named_parameters() if p.grad is not None}
    state = {n: t.clone() for n, t in pipe.state_dict().items()}
    dist.destroy_process_group()
    return {"grads": grads, "state": state}


@pytest.mark.parametrize("schedule", ["1f1b", "zero-bubble"])
def test_a_stage_that_changes_its_input_in_place_trains_like_the_unsplit_model(schedule: str) -> None:
    # A received input is a leaf whose gradient is sent back, and autograd refuses to change a leaf in place:
    # ReLU(inplace=True) right after a cut failed the step. The stage now runs on a copy, and the batch norm that
    # ran before the refused change moves its statistics once per micro-batch, not twice.
    reference = model()
    x, y = batch()
    opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for _ in range(2):
        opt.zero_grad()
        for xs, ys in zip(x.tensor_split(M), y.tensor_split(M), strict=True):
            (mse(reference(xs), ys) * len(xs) / len(x)).backward()
        opt.step()
    held: set[str] = set()
    for result in run_ranks(train, 3, schedule, timeout=120).values():
        for name, grad in result["grads"].items():
            torch.testing.assert_close(grad, dict(reference.named_parameters())[name].grad, msg=name)
        for name, value in result["state"].items():
            torch.testing.assert_close(value, reference.state_dict()[name], msg=name)
        held |= set(result["state"])
    assert held == set(reference.state_dict())
