"""One timeout: the mesh's bounds every process group and every kind of wait of the Pipeline, which has none of its
own."""

from __future__ import annotations

import functools
import inspect
import os
import sys
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from support.multiproc import run_ranks

from stagewise.comm import errors, init_mesh, waits
from stagewise.models import GPT, GPTConfig
from stagewise.partition import Partition
from stagewise.pipeline import Pipeline

CONFIG = GPTConfig(vocab_size=32, seq_len=8, d_model=16, n_layers=3, n_heads=2, tie_embeddings=True)
TIMEOUT = 17.0


def _seconds(value: object) -> float | None:
    """A timeout as seconds, whether given as a timedelta or a number (None: none given)."""
    if isinstance(value, timedelta):
        return value.total_seconds()
    return None if value is None else float(value)  # type: ignore[arg-type]


def _recording(fn: Callable[..., Any], kind: str, seen: list[tuple[str, float | None]]) -> Callable[..., Any]:
    """``fn``, noting the timeout each call gives it (with what it waits for) in ``seen``."""

    @functools.wraps(fn)
    def recorded(*args: Any, **kwargs: Any) -> Any:
        seen.append((f"{kind}: {kwargs.get('what', '')}", _seconds(kwargs.get("timeout"))))
        return fn(*args, **kwargs)

    return recorded


def _patch_waits(seen: list[tuple[str, float | None]]) -> None:
    """Record every call of the two wait primitives, wherever a stagewise module took them by name."""
    originals = {"named_collective": errors.named_collective, "wait_for": waits.wait_for}
    for module in [m for name, m in sys.modules.items() if name.startswith("stagewise.")]:
        for name, original in originals.items():
            if getattr(module, name, None) is original:
                setattr(module, name, _recording(original, name, seen))


def timeouts_seen() -> dict[str, object]:
    """Build a mesh and a pipeline on it (pp=2, dp=2, a tied embedding across its ranks), step it over the
    transport's gloo groups and clip; return every timeout a wait or a process group was given, the transport's,
    and whether the pipeline has a timeout of its own."""
    torch.set_num_threads(1)
    os.environ["STAGEWISE_SHARED_MEMORY"] = "0"  # the transport over its gloo groups, waiting with wait_for
    seen: list[tuple[str, float | None]] = []
    _patch_waits(seen)
    groups: list[float] = []
    new_group = dist.new_group

    def recording_group(*args: Any, **kwargs: Any) -> Any:
        groups.append(_seconds(kwargs.get("timeout")) or -1.0)
        return new_group(*args, **kwargs)

    dist.new_group = recording_group  # type: ignore[assignment]
    mesh = init_mesh(2, 2, timeout=TIMEOUT)
    model = GPT(CONFIG, device="meta")
    part = Partition.from_bounds((0, 2, 6))

    def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out.flatten(0, 1), y.flatten())

    pipe = Pipeline(model, part, n_microbatches=2, loss_fn=loss_fn, mesh=mesh)
    dist.new_group = new_group  # type: ignore[assignment]
    ids = torch.randint(0, CONFIG.vocab_size, (4, CONFIG.seq_len + 1), generator=torch.Generator().manual_seed(1))
    pipe.step(ids[:, :-1], ids[:, 1:])
    pipe.clip_grad_norm_(1.0)
    pipe.evaluate(ids[:, :-1], ids[:, 1:])
    transport = pipe._runtime.transport
    out = {"own": hasattr(pipe, "timeout"), "transport": _seconds(transport.timeout), "waits": seen, "groups": groups}
    pipe.close()
    dist.destroy_process_group()
    return out


@pytest.mark.timeout(240)
def test_one_timeout_bounds_every_kind_of_wait() -> None:
    results = run_ranks(timeouts_seen, 4, timeout=180)
    kinds = set()
    for rank, got in results.items():
        assert got["own"] is False, rank
        assert got["transport"] == TIMEOUT, rank
        # the mesh's pp and dp groups (DDP, clipping, the loss's all-gather), the ties' and the transport's
        assert got["groups"] and set(got["groups"]) == {TIMEOUT}, (rank, got["groups"])
        waits_seen = got["waits"]
        assert isinstance(waits_seen, list)
        wrong = [(what, value) for what, value in waits_seen if value != TIMEOUT]
        assert not wrong, (rank, wrong)
        kinds |= {what for what, _ in waits_seen}
    for part in (
        "wait_for: the activation",
        "wait_for: the gradient",
        "wait_for: the loss",
        "tied parameter",
        "DDP's all-reduce",
        "all-reduce of the gradients' norm",
        "all-gather of the replicas'",
    ):
        assert any(part in what for what in kinds), (part, sorted(kinds))


def test_a_pipeline_takes_no_timeout_of_its_own() -> None:
    assert "timeout" not in inspect.signature(Pipeline).parameters
    with pytest.raises(TypeError, match="timeout"):
        Pipeline(GPT(CONFIG, device="meta"), Partition.from_bounds((0, 2, 6)), n_microbatches=2, loss_fn=F.mse_loss,
                 timeout=5)  # type: ignore[call-arg]  # fmt: skip


@pytest.mark.parametrize(("bad", "error"), [(0, ValueError), (float("nan"), ValueError), ("5", TypeError)])
def test_a_bad_timeout_is_refused_before_any_process_group(bad: object, error: type[Exception]) -> None:
    with pytest.raises(error, match="timeout must be"):
        init_mesh(2, timeout=bad)  # type: ignore[arg-type]
