"""Deferred batch norm: micro-batches normalised with their own statistics, running statistics moved once per step."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal, get_args

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.overrides import TorchFunctionMode

from stagewise.comm.errors import named_collective
from stagewise.partition import Layer
from stagewise.partition.segment import Segment
from stagewise.pipeline.config import BatchNormStatistics

log = logging.getLogger(__name__)

StatisticsSource = Literal["micro-batch", "batch", "global-batch"]
"""A :data:`BatchNormStatistics` with "auto" resolved for a model (see :func:`statistics_source`)."""

CHOICES: tuple[str, ...] = get_args(BatchNormStatistics)
"""Every :data:`BatchNormStatistics`."""

_UNDEFERRABLE = frozenset(
    {
        torch.ops.aten._native_batch_norm_legit_functional.default,
        torch.ops.aten._native_batch_norm_legit.default,
    }
)
"""Batch-norm ops of captured graphs that hand back (or write) the new running statistics themselves: a graph
made of them (older torch.export IR) cannot have its updates deferred. Captures that call ``aten.batch_norm``
(torch.export's training IR) can."""


def tracks_statistics(module: nn.Module) -> bool:
    """Whether ``module`` is a batch norm that keeps running statistics (its training forward moves them)."""
    return isinstance(module, _BatchNorm) and module.track_running_stats and module.running_mean is not None


def _undeferrable(layer: nn.Module) -> bool:
    return isinstance(layer, Segment) and any(node.target in _UNDEFERRABLE for node in layer.graph.module.graph.nodes)


def statistics_source(choice: BatchNormStatistics, layers: Sequence[Layer], n_microbatches: int) -> StatisticsSource:
    """``choice`` for a model of ``layers`` run in ``n_microbatches``: "auto" is "batch" when the model has batch
    norms that track running statistics and a step has more than one micro-batch, else "micro-batch".

    Raises:
        ValueError: "batch" or "global-batch" for a captured model whose graph updates its running statistics
            inside its batch-norm ops (older torch.export IR), which cannot be deferred.
    """
    if choice not in CHOICES:
        raise ValueError(f"batch_norm must be one of {list(CHOICES)}, got {choice!r}")
    norms = [layer.name for layer in layers if any(tracks_statistics(m) for m in layer.module.modules())]
    stuck = [layer.name for layer in layers if _undeferrable(layer.module)]
    if choice == "auto":
        if not norms or n_microbatches == 1:
            return "micro-batch"
        if stuck:
            log.warning(
                "captured segments %s update batch norms' running statistics inside their graph "
                "(_native_batch_norm_legit ops): they move once per micro-batch, not once per step",
                stuck,
            )
            return "micro-batch"
        return "batch"
    if choice != "micro-batch" and stuck:
        raise ValueError(
            f"batch_norm={choice!r} cannot defer the running statistics of captured segments {stuck}: their graph "
            "updates them inside aten._native_batch_norm_legit ops (an older torch.export IR); capture the model "
            "with a torch whose export keeps aten.batch_norm, or pass batch_norm='micro-batch'"
        )
    return choice


@dataclass
class Moments:
    """What a batch norm normalised, per channel: the count of values, their sum and sum of squares (float64)."""

    count: int
    """Values per channel: samples times the spatial positions of each."""
    total: torch.Tensor
    """Per-channel sum, float64."""
    squares: torch.Tensor
    """Per-channel sum of squares, float64."""

    @classmethod
    def of(cls, x: torch.Tensor) -> Moments:
        """The moments of a batch norm's input ``[N, C, *]``, over every dimension but the channels (dim 1).

        Its mean and variance come from ``torch.var_mean`` (at least float32, as the batch norm's own); the sums
        are float64, so that taking the square of the mean back out of the sum of squares, for the batch's
        variance, cancels float64 digits only.
        """
        with torch.no_grad():
            data = x.detach()
            if data.dtype != torch.float64:
                data = data.float()
            var, mean = torch.var_mean(data, dim=[0, *range(2, data.dim())], correction=0)
            count = data.numel() // data.shape[1]
            mean, var = mean.double(), var.double()
            return cls(count, mean * count, (var + mean * mean) * count)

    def __add__(self, other: Moments) -> Moments:
        return Moments(self.count + other.count, self.total + other.total, self.squares + other.squares)


def update_running(norm: _BatchNorm, moments: Moments) -> None:
    """Move ``norm``'s running statistics once, as its training forward on the batch of ``moments`` would.

    ``num_batches_tracked`` counts one batch; the running mean and variance move by ``momentum`` (or, when
    it is None, by ``1 / num_batches_tracked``: the cumulative average) towards the batch's mean and
    unbiased variance (``n / (n - 1)`` times the biased one), as torch's batch norm moves them.
    """
    if moments.count == 0 or norm.running_mean is None or norm.running_var is None:
        return
    n = moments.count
    mean = moments.total / n
    variance = (moments.squares / n - mean * mean).clamp_(min=0.0)
    unbiased = variance * (n / (n - 1)) if n > 1 else variance
    with torch.no_grad():
        tracked = norm.num_batches_tracked
        factor: float | torch.Tensor = 0.0 if norm.momentum is None else norm.momentum
        if tracked is not None:
            tracked.add_(1)
            if norm.momentum is None:
                factor = 1.0 / tracked.double()
        for buffer, batch in ((norm.running_mean, mean), (norm.running_var, unbiased)):
            buffer.copy_(buffer.double() * (1 - factor) + batch.to(buffer.device) * factor)


@dataclass(frozen=True)
class _Arguments:
    """Where a batch-norm function takes the arguments that matter here, by position or by name."""

    names: tuple[str, ...]
    """Its parameters, in order."""

    def get(self, args: Sequence[Any], kwargs: Mapping[str, Any], name: str, default: Any = None) -> Any:
        index = self.names.index(name)
        return args[index] if index < len(args) else kwargs.get(name, default)

    def without_running(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The same call with no running statistics: the batch norm normalises with the batch's, moving none."""
        new_args, new_kwargs = list(args), dict(kwargs)
        for name in ("running_mean", "running_var"):
            index = self.names.index(name)
            if index < len(new_args):
                new_args[index] = None
            else:
                new_kwargs[name] = None
        return tuple(new_args), new_kwargs


def _schema_names(op: Any) -> tuple[str, ...]:
    return tuple(argument.name for argument in op._schema.arguments)


_ATEN = _schema_names(torch.ops.aten.batch_norm.default)
_BATCH_NORMS: dict[Callable[..., Any], _Arguments] = {
    F.batch_norm: _Arguments(("input", "running_mean", "running_var", "weight", "bias", "training", "momentum", "eps")),
    torch.batch_norm: _Arguments(_ATEN),
    torch.ops.aten.batch_norm.default: _Arguments(_ATEN),
}
"""The calls by which batch norms run: ``_BatchNorm.forward``'s, and a captured graph's (``aten.batch_norm``)."""


class _Deferring(TorchFunctionMode):
    """Runs a stage's tracked batch norms without their running statistics, and hands their inputs to ``norms``."""

    def __init__(self, norms: StageNorms) -> None:
        super().__init__()
        self.norms = norms

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: object,
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        where = _BATCH_NORMS.get(func)
        if where is not None and where.get(args, kwargs, "training", False):
            running = where.get(args, kwargs, "running_mean")
            index = self.norms.index_of(running) if isinstance(running, torch.Tensor) else None
            if index is not None:
                self.norms.saw(index, where.get(args, kwargs, "input"))
                args, kwargs = where.without_running(args, kwargs)
        return func(*args, **kwargs)


class StageNorms:
    """The batch norms of one stage whose running statistics move once per step, and what its forwards saw.

    A stage runs its layers within :meth:`forward` and under :meth:`mode`: every tracked batch norm
    (:func:`tracks_statistics`) in training normalises with its micro-batch's statistics as always, but is
    called without its running statistics, so that nothing moves them; the mode keeps the
    :class:`Moments` of its input instead. ``num_batches_tracked``, which the module's forward counts
    itself, is put back when the forward ends. A forward that collects adds its moments to the step's
    (:attr:`seen`) when it succeeds, so a forward that fails and is run again counts once; a recomputation
    (activation checkpointing, during backward) and a forward-only pass collect nothing.
    """

    def __init__(self, stage: nn.Module) -> None:
        self.norms: list[_BatchNorm] = [m for m in stage.modules() if tracks_statistics(m)]  # type: ignore[misc]
        """The stage's tracked batch norms, in module order."""
        self.seen: dict[int, Moments] = {}
        """The moments of each batch norm (by index in :attr:`norms`) over this step's forwards so far."""
        self._pending: dict[int, Moments] | None = None
        self._buffers: dict[int, int] = {}

    def index_of(self, running_mean: torch.Tensor) -> int | None:
        """The index of the tracked batch norm whose running mean this is, or None."""
        return self._buffers.get(id(running_mean))

    def saw(self, index: int, x: torch.Tensor) -> None:
        """Batch norm ``index`` normalised ``x``: kept when the forward running now collects."""
        if self._pending is None:
            return
        moments = Moments.of(x)
        earlier = self._pending.get(index)
        self._pending[index] = moments if earlier is None else earlier + moments

    def mode(self) -> TorchFunctionMode:
        """The torch-function mode under which the stage's layers run (within the checkpointed call, so that a
        recomputation calls its batch norms as the forward did)."""
        return _Deferring(self)

    @contextmanager
    def forward(self, *, collect: bool) -> Iterator[None]:
        """Around one forward of the stage's layers: with ``collect``, the moments it sees count for the step
        if it completes; its counts of batches (``num_batches_tracked``) are put back either way."""
        self._buffers = {id(norm.running_mean): i for i, norm in enumerate(self.norms)}
        counters = [(t, t.clone()) for t in (norm.num_batches_tracked for norm in self.norms) if t is not None]
        pending: dict[int, Moments] = {}
        self._pending = pending if collect else None
        try:
            yield
        finally:
            self._pending = None
            with torch.no_grad():
                for counter, value in counters:
                    counter.copy_(value)
        for index, moments in pending.items():
            earlier = self.seen.get(index)
            self.seen[index] = moments if earlier is None else earlier + moments


class DeferredBatchNorm:
    """This rank's batch norms whose running statistics move once per :meth:`stagewise.Pipeline.step`.

    Each stage with tracked batch norms gets a :class:`StageNorms`; :meth:`commit` moves every one once,
    from the moments its forwards of the step saw (with ``group``: summed over the replicas first).
    """

    def __init__(
        self, stages: Mapping[int, nn.Module], *, group: dist.ProcessGroup | None = None, timeout: float | None = None
    ) -> None:
        every = {s: StageNorms(stage) for s, stage in sorted(stages.items())}
        self.stages = {s: norms for s, norms in every.items() if norms.norms}
        """The stages that have tracked batch norms, by number."""
        self.group = group
        """Sum the moments over this group (the stage's replicas) before moving the statistics; None: do not."""
        self.timeout = timeout

    def begin(self) -> None:
        """Forget what an earlier, unfinished step saw."""
        for norms in self.stages.values():
            norms.seen.clear()

    def commit(self) -> None:
        """Move each tracked batch norm's running statistics once, from what the step's forwards saw."""
        entries = [(norms, i, norm) for norms in self.stages.values() for i, norm in enumerate(norms.norms)]
        moments = [norms.seen.get(i) for norms, i, _ in entries]
        if self.group is not None and self.group.size() > 1 and entries:
            moments = self._summed([norm for _, _, norm in entries], moments)
        for (_, _, norm), seen in zip(entries, moments, strict=True):
            if seen is not None:
                update_running(norm, seen)
        self.begin()

    def _summed(self, norms: list[_BatchNorm], moments: list[Moments | None]) -> list[Moments | None]:
        """``moments`` summed over :attr:`group`, in one all-reduce of float64 ``[count, sum, squares]`` rows."""
        assert self.group is not None
        rows = []
        for norm, seen in zip(norms, moments, strict=True):
            assert norm.running_mean is not None
            device, channels = norm.running_mean.device, norm.running_mean.numel()
            if seen is None:
                rows.append(torch.zeros(1 + 2 * channels, dtype=torch.float64, device=device))
            else:
                count = torch.tensor([float(seen.count)], dtype=torch.float64, device=device)
                rows.append(torch.cat([count, seen.total.to(device), seen.squares.to(device)]))
        flat = torch.cat(rows)
        rank = dist.get_rank()
        peer = next((r for r in dist.get_process_group_ranks(self.group) if r != rank), rank)
        what = f"the all-reduce of {len(norms)} batch norms' statistics over the replicas"
        with named_collective(rank=rank, peer=peer, what=what, timeout=self.timeout):
            dist.all_reduce(flat, group=self.group)
        pieces = torch.split(flat, [len(r) for r in rows])
        counts = torch.stack([piece[0] for piece in pieces]).tolist()  # one device sync for all of them
        out: list[Moments | None] = []
        for piece, count in zip(pieces, counts, strict=True):
            channels = (len(piece) - 1) // 2
            whole = round(count)
            out.append(Moments(whole, piece[1 : 1 + channels], piece[1 + channels :]) if whole else None)
        return out
