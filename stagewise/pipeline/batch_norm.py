"""Deferred batch norm: micro-batch statistics normalise, the running statistics move once per step, by the batch's."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils.hooks import RemovableHandle

from stagewise.comm import named_collective

log = logging.getLogger(__name__)

BatchNormMode = Literal["micro-batch", "deferred", "deferred-global"]
"""How batch norms in training mode treat a step's micro-batches:

- ``"micro-batch"``: as torch does for each forward: each micro-batch normalises by its own statistics and moves
  the running statistics (``num_batches_tracked`` counts micro-batches);
- ``"deferred"``: each micro-batch still normalises by its own statistics (as gradient accumulation does), but
  the running statistics and ``num_batches_tracked`` move once per step, by the statistics of the replica's whole
  batch, as the unsplit model's would on that batch;
- ``"deferred-global"``: the same, by the statistics of the global batch over the data-parallel replicas (as
  ``SyncBatchNorm`` would move them).
"""

_RECOMPUTING = [False]
"""Whether a checkpointed forward is being recomputed (its statistics were counted in the forward)."""


@contextmanager
def recomputing() -> Iterator[None]:
    """Within, forwards are recomputations: deferred batch norms count nothing."""
    before = _RECOMPUTING[0]
    _RECOMPUTING[0] = True
    try:
        yield
    finally:
        _RECOMPUTING[0] = before


def batch_norms(modules: Iterable[nn.Module]) -> list[_BatchNorm]:
    """The batch norms among ``modules`` and their submodules that keep running statistics, each once."""
    seen: dict[int, _BatchNorm] = {}
    for module in modules:
        for sub in module.modules():
            if isinstance(sub, _BatchNorm) and sub.track_running_stats:
                seen.setdefault(id(sub), sub)
    return list(seen.values())


@dataclass
class _Sums:
    """One batch norm's statistics of a step so far, per channel, in float64."""

    count: int = 0
    total: torch.Tensor | None = None
    """Sum of the inputs."""
    squares: torch.Tensor | None = None
    """Sum of the squared inputs."""

    def add(self, x: torch.Tensor) -> None:
        dims = [d for d in range(x.dim()) if d != 1]
        values = x.detach().to(torch.float64)
        total, squares = values.sum(dims), (values * values).sum(dims)
        self.count += x.numel() // x.shape[1]
        self.total = total if self.total is None else self.total + total
        self.squares = squares if self.squares is None else self.squares + squares


@dataclass
class DeferredBatchNorm:
    """Defers the running statistics of ``norms`` to :meth:`commit`, once per step (see :data:`BatchNormMode`).

    Each batch norm runs its forward with ``track_running_stats`` off (so it
    normalises by the micro-batch and moves nothing), after counting the
    micro-batch's per-channel sums. :meth:`commit` moves the running mean,
    the running variance (unbiased, as torch's) and ``num_batches_tracked``
    once, with the batch norm's ``momentum`` (or its cumulative average when
    that is None), from the sums of the whole step: over this replica, or
    over every replica (``group``, all-reduced with a wait of ``timeout``).
    """

    norms: list[_BatchNorm]
    group: dist.ProcessGroup | None = None
    """The data-parallel group to sum the statistics over; None: this replica's alone."""
    timeout: float = 300.0
    rank: int = 0
    _sums: dict[int, _Sums] = field(default_factory=dict)
    _handles: list[RemovableHandle] = field(default_factory=list)

    def __post_init__(self) -> None:
        for norm in self.norms:
            self._handles.append(norm.register_forward_pre_hook(self._before))
            self._handles.append(norm.register_forward_hook(self._after, always_call=True))

    def _before(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        if not module.training or not isinstance(module, _BatchNorm):
            return
        if not _RECOMPUTING[0] and args and isinstance(args[0], torch.Tensor):
            self._sums.setdefault(id(module), _Sums()).add(args[0])
        module.track_running_stats = False

    def _after(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        if isinstance(module, _BatchNorm):
            module.track_running_stats = True

    def begin(self) -> None:
        """Forget what was counted outside a step (a forward-only pass in training mode)."""
        self._sums.clear()

    def commit(self) -> None:
        """Move every batch norm's running statistics once, by the step's statistics."""
        counted = [(norm, self._sums[id(norm)]) for norm in self.norms if id(norm) in self._sums]
        self._sums.clear()
        if self.group is not None:
            self._sum_over_replicas(counted)
        with torch.no_grad():
            for norm, sums in counted:
                _update(norm, sums)

    def _sum_over_replicas(self, counted: list[tuple[_BatchNorm, _Sums]]) -> None:
        """Sum every batch norm's counts and sums over the replicas, in one all-reduce."""
        if not counted:
            return
        parts = []
        for _, sums in counted:
            assert sums.total is not None and sums.squares is not None
            parts += [torch.tensor([float(sums.count)], dtype=torch.float64, device=sums.total.device)]
            parts += [sums.total, sums.squares]
        flat = torch.cat(parts)
        peer = next((r for r in dist.get_process_group_ranks(self.group) if r != self.rank), self.rank)
        what = "the all-reduce of the replicas' batch-norm statistics"
        with named_collective(rank=self.rank, peer=peer, what=what, timeout=self.timeout):
            dist.all_reduce(flat, group=self.group)
        offset = 0
        for _, sums in counted:
            channels = sums.total.numel() if sums.total is not None else 0
            sums.count = round(float(flat[offset]))
            sums.total = flat[offset + 1 : offset + 1 + channels]
            sums.squares = flat[offset + 1 + channels : offset + 1 + 2 * channels]
            offset += 1 + 2 * channels

    def close(self) -> None:
        """Remove the hooks: the batch norms behave as torch's again."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


def _update(norm: _BatchNorm, sums: _Sums) -> None:
    """Move ``norm``'s running statistics once by a batch of ``sums``, as its own forward on that batch would."""
    assert sums.total is not None and sums.squares is not None and norm.running_mean is not None
    assert norm.running_var is not None and norm.num_batches_tracked is not None
    n = sums.count
    mean = sums.total / n
    biased = (sums.squares / n - mean * mean).clamp_min(0)
    unbiased = biased * (n / (n - 1)) if n > 1 else biased
    norm.num_batches_tracked.add_(1)
    factor = 1.0 / float(norm.num_batches_tracked) if norm.momentum is None else norm.momentum
    running_mean, running_var = norm.running_mean, norm.running_var
    running_mean.mul_(1 - factor).add_(mean.to(running_mean.dtype), alpha=factor)
    running_var.mul_(1 - factor).add_(unbiased.to(running_var.dtype), alpha=factor)


def deferred_mode(
    mode: BatchNormMode | None, norms: list[_BatchNorm], n_microbatches: int, *, captured: bool
) -> BatchNormMode:
    """The mode in effect: ``mode``, or by default ``"deferred"`` where the stages hold batch norms that run as
    modules and a step has several micro-batches, else ``"micro-batch"``; refused for a captured model's batch
    norms, which run inside its graph, not as modules."""
    if mode is None:
        return "deferred" if norms and n_microbatches > 1 and not captured else "micro-batch"
    if mode != "micro-batch" and captured and norms:
        raise ValueError(
            f"batch_norm={mode!r} defers the running statistics of batch norms that run as modules, but this model "
            "was captured (its batch norms are ops of its graph); use batch_norm='micro-batch', or make the model a "
            "chain of modules (an nn.Sequential) so that stagewise splits it without capturing it"
        )
    return mode
