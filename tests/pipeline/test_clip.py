"""Clipping by the norm of gradients spread over ranks equals torch's clip_grad_norm_ on all of them at once."""

from __future__ import annotations

import math
import time

import pytest
import torch
import torch.distributed as dist
from support.late import comm_error
from support.multiproc import run_ranks
from torch import nn

from stagewise.comm import init_mesh
from stagewise.pipeline.backward.clip import clip_grad_norm_

GRADS = ([1.0, -2.0, 3.0], [0.5, 4.0, -1.0])
"""The gradient of each rank's one parameter."""


def _param(values: list[float], *, nan: bool = False) -> nn.Parameter:
    p = nn.Parameter(torch.zeros(len(values)))
    p.grad = torch.tensor(values)
    if nan:
        p.grad[0] = math.nan
    return p


def clip_cases() -> dict[str, object]:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.group.WORLD
    out: dict[str, object] = {}
    for nan_rank in (0, 1):
        mine = _param(GRADS[rank], nan=rank == nan_rank)
        out[f"inf norm, NaN on rank {nan_rank}"] = float(clip_grad_norm_([mine], 1.0, math.inf, group=world))
        try:
            clip_grad_norm_([_param(GRADS[rank], nan=rank == nan_rank)], 1.0, math.inf, group=world,
                            error_if_nonfinite=True)  # fmt: skip
            out[f"raised, NaN on rank {nan_rank}"] = False
        except RuntimeError:
            out[f"raised, NaN on rank {nan_rank}"] = True
    for norm_type in (2.0, math.inf):
        layer = nn.Linear(3, 1, bias=False)
        layer.weight.grad = torch.tensor([GRADS[rank]])
        norm = clip_grad_norm_(layer.parameters(), 0.5, norm_type, group=world)  # a generator, read once
        out[f"generator {norm_type}"] = (float(norm), layer.weight.grad.clone())
    double = nn.Parameter(torch.zeros(3, dtype=torch.float64))
    double.grad = torch.tensor(GRADS[rank], dtype=torch.float64) / 3
    norm = clip_grad_norm_([double], 0.5, group=world)
    out["float64"] = (norm.dtype, float(norm), double.grad.clone())
    zeroed = _param(GRADS[rank])
    clip_grad_norm_([zeroed], 0.0, group=world)
    out["max_norm 0"] = zeroed.grad.clone()  # type: ignore[union-attr]
    dist.destroy_process_group()
    return out


def _torch_reference(
    max_norm: float, norm_type: float, *, nan_rank: int | None = None
) -> tuple[float, list[torch.Tensor]]:
    params = [_param(g, nan=r == nan_rank) for r, g in enumerate(GRADS)]
    norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type))
    return norm, [p.grad for p in params]  # type: ignore[misc]


def test_clipping_over_two_ranks_equals_torch_on_the_whole_model() -> None:
    results = run_ranks(clip_cases, 2, timeout=60)
    for rank, got in results.items():
        for nan_rank in (0, 1):
            # Whichever rank holds the NaN, the total is NaN (a max all-reduce alone would drop it on some orders).
            assert math.isnan(_torch_reference(1.0, math.inf, nan_rank=nan_rank)[0])
            assert math.isnan(got[f"inf norm, NaN on rank {nan_rank}"]), (rank, nan_rank, got)  # type: ignore[arg-type]
            assert got[f"raised, NaN on rank {nan_rank}"] is True, (rank, nan_rank)
        for norm_type in (2.0, math.inf):
            want_norm, want_grads = _torch_reference(0.5, norm_type)
            norm, grad = got[f"generator {norm_type}"]  # type: ignore[misc]
            assert norm == pytest.approx(want_norm)
            torch.testing.assert_close(grad[0], want_grads[rank])
        doubles = [nn.Parameter(torch.zeros(3, dtype=torch.float64)) for _ in GRADS]
        for p, g in zip(doubles, GRADS, strict=True):
            p.grad = torch.tensor(g, dtype=torch.float64) / 3
        want = torch.nn.utils.clip_grad_norm_(doubles, 0.5)
        dtype, norm, grad = got["float64"]  # type: ignore[misc]
        assert dtype == torch.float64 and norm == pytest.approx(float(want), rel=1e-15)
        torch.testing.assert_close(grad, doubles[rank].grad, atol=1e-15, rtol=1e-15)
        _, zeroed = _torch_reference(0.0, 2.0)
        torch.testing.assert_close(got["max_norm 0"], zeroed[rank])


def test_a_negative_max_norm_is_refused() -> None:
    with pytest.raises(ValueError, match=r"max_norm must be >= 0 \(0 zeroes the gradients, as in torch\), got -1"):
        clip_grad_norm_([_param([1.0])], -1.0, group=None)  # type: ignore[arg-type]


def late_to_clip() -> str:
    init_mesh(2, timeout=3)
    param = _param([3.0, 4.0])
    if dist.get_rank() == 1:
        time.sleep(4.5)  # past the timeout
    return comm_error(lambda: clip_grad_norm_([param], 1.0, group=dist.group.WORLD, timeout=3))


def test_a_rank_late_to_the_norm_gives_a_named_timeout() -> None:
    # The all-reduce of the norm timed out with gloo's bare RuntimeError, naming no rank and nothing awaited.
    message = run_ranks(late_to_clip, 2, timeout=60)[0]
    assert message.startswith("CommTimeoutError: rank 0 timed out after 3 s in the all-reduce of the gradients' norm")
