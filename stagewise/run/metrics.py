"""What a run measures at each step and evaluation, and where rank 0 writes it: metrics.jsonl, TensorBoard, W&B.

Each step's record holds the loss, the gradients' global norm, the learning
rate, the step's time, tokens (or samples) per second, the model FLOPs
utilisation and every rank's peak memory. MFU is the model's FLOPs (three
times its forward's, per sample: forward and backward, recomputation not
counted) per second over the devices' peak: on a GPU, a bf16 or fp32 matmul's
measured rate; on a CPU, a matmul's measured with the threads a rank has.
"""

from __future__ import annotations

import json
import logging
import math
import os
import resource
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, Protocol, cast, get_args

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepMetrics:
    """One training step, as rank 0 records it."""

    step: int
    """Optimizer steps done, this one included."""
    loss: float
    """The global batch's loss."""
    grad_norm: float
    """The global norm of the gradients before clipping (NaN for a step skipped for a non-finite loss)."""
    lr: float
    """The learning rate of the step."""
    step_seconds: float
    """Wall-clock seconds of the step (forward, backward, clipping, update)."""
    per_second: float
    """Tokens (or samples, for models that read no tokens) trained per second in this step."""
    mfu: float
    """Model FLOPs per second over the devices' peak (0 to 1)."""
    peak_memory: tuple[int, ...]
    """Each rank's peak memory so far, bytes: allocated on its GPU, resident on the CPU."""
    balance_loss: float = 0.0
    """The mixture-of-experts layers' load-balancing loss, included in ``loss`` (0 for a model without)."""


@dataclass(frozen=True)
class EvalMetrics:
    """One evaluation on the held-out data."""

    step: int
    loss: float
    """Mean loss over the evaluation batches."""

    @property
    def perplexity(self) -> float:
        """``exp(loss)``, infinite past what a float holds."""
        return math.exp(self.loss) if self.loss < 700 else math.inf


def peak_memory(device: torch.device) -> int:
    """This process's peak memory so far, bytes: allocated on its GPU, or resident (maximum RSS) on the CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux reports KiB


def every_peak_memory(device: torch.device) -> tuple[int, ...]:
    """Every rank's :func:`peak_memory`, in rank order (a collective; this process's alone without a group)."""
    mine = peak_memory(device)
    if not dist.is_initialized():
        return (mine,)
    gathered = torch.empty(dist.get_world_size(), dtype=torch.int64, device=device)
    dist.all_gather_single(gathered, torch.tensor([mine], dtype=torch.int64, device=device))
    return tuple(int(v) for v in gathered.tolist())


def matmul_peak(device: torch.device, dtype: torch.dtype = torch.float32, size: int = 1024) -> float:
    """FLOP/s of a ``size`` x ``size`` matmul of ``dtype`` on ``device``, measured now (the best of 5 runs): the
    peak a rank can reach there, with the threads it has."""
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    best = math.inf
    for _ in range(6):  # the first warms up
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        began = time.perf_counter()
        torch.mm(a, b)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - began)
    return 2 * size**3 / best


class _Sink(Protocol):
    def step(self, metrics: StepMetrics) -> None: ...
    def evaluation(self, metrics: EvalMetrics) -> None: ...
    def close(self) -> None: ...


def _jsonable(value: float) -> float | None:
    return value if math.isfinite(value) else None


class JsonLines:
    """One JSON object a line, appended and flushed as it comes (a resumed run appends to its run's file)."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._file = path.open("a")

    def _write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record, allow_nan=False) + "\n")
        self._file.flush()

    def step(self, metrics: StepMetrics) -> None:
        record = asdict(metrics)
        self._write({k: _jsonable(v) if isinstance(v, float) else v for k, v in record.items()})

    def evaluation(self, metrics: EvalMetrics) -> None:
        self._write(
            {"step": metrics.step, "eval_loss": _jsonable(metrics.loss), "perplexity": _jsonable(metrics.perplexity)}
        )

    def close(self) -> None:
        self._file.close()


class TensorBoard:
    """Scalars for TensorBoard (``torch.utils.tensorboard``; the ``tensorboard`` package)."""

    def __init__(self, folder: Path) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as err:
            raise ImportError(
                "--tensorboard needs the tensorboard package: pip install 'stagewise[tensorboard]'"
            ) from err
        self.writer = SummaryWriter(log_dir=str(folder))

    def step(self, metrics: StepMetrics) -> None:
        for name in ("loss", "balance_loss", "grad_norm", "lr", "step_seconds", "per_second", "mfu"):
            self.writer.add_scalar(f"train/{name}", getattr(metrics, name), metrics.step)
        self.writer.add_scalar("train/peak_memory_max", max(metrics.peak_memory), metrics.step)

    def evaluation(self, metrics: EvalMetrics) -> None:
        self.writer.add_scalar("eval/loss", metrics.loss, metrics.step)
        self.writer.add_scalar("eval/perplexity", metrics.perplexity, metrics.step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


WandbMode = Literal["online", "offline", "disabled", "shared"]
"""The modes of a Weights & Biases run (``WANDB_MODE``)."""


class WeightsAndBiases:
    """A Weights & Biases run (the ``wandb`` package); offline unless ``WANDB_MODE`` says otherwise, so it needs
    no network: ``wandb sync`` uploads it later."""

    def __init__(self, folder: Path, config: dict[str, Any]) -> None:
        try:
            import wandb
        except ImportError as err:
            raise ImportError("--wandb needs the wandb package: pip install 'stagewise[wandb]'") from err
        mode = os.environ.get("WANDB_MODE", "offline")
        if mode not in get_args(WandbMode):
            raise ValueError(
                f"WANDB_MODE is {mode!r}; --wandb takes one of {list(get_args(WandbMode))} (default offline)"
            )
        folder.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(project="stagewise", dir=str(folder), config=config, mode=cast(WandbMode, mode))

    def step(self, metrics: StepMetrics) -> None:
        record = {f"train/{k}": v for k, v in asdict(metrics).items() if k not in ("step", "peak_memory")}
        self.run.log(record | {"train/peak_memory_max": max(metrics.peak_memory)}, step=metrics.step)

    def evaluation(self, metrics: EvalMetrics) -> None:
        self.run.log({"eval/loss": metrics.loss, "eval/perplexity": metrics.perplexity}, step=metrics.step)

    def close(self) -> None:
        self.run.finish()


@dataclass(frozen=True)
class Destinations:
    """Where a run's metrics go (rank 0 writes them)."""

    jsonl: Path | None = None
    """metrics.jsonl; None: not written."""
    tensorboard: Path | None = None
    """A TensorBoard log folder; None: none."""
    wandb: Path | None = None
    """A folder for an offline Weights & Biases run; None: none."""


class MetricsLog:
    """Rank 0's sinks for a run's metrics (the other ranks' log writes nothing); close it, or use it in ``with``."""

    def __init__(self, where: Destinations, config: dict[str, Any], *, writer: bool) -> None:
        self._sinks: list[_Sink] = []
        if not writer:
            return
        if where.jsonl is not None:
            self._sinks.append(JsonLines(where.jsonl))
        if where.tensorboard is not None:
            self._sinks.append(TensorBoard(where.tensorboard))
        if where.wandb is not None:
            self._sinks.append(WeightsAndBiases(where.wandb, config))

    def step(self, metrics: StepMetrics) -> None:
        for sink in self._sinks:
            sink.step(metrics)

    def evaluation(self, metrics: EvalMetrics) -> None:
        for sink in self._sinks:
            sink.evaluation(metrics)

    def close(self) -> None:
        for sink in self._sinks:
            try:
                sink.close()
            except Exception as err:  # one sink's failure at the end must not lose the others' records
                log.warning("closing %s: %s", type(sink).__name__, err)
        self._sinks = []

    def __enter__(self) -> MetricsLog:
        return self

    def __exit__(self, *exc: type[BaseException] | BaseException | TracebackType | None) -> None:
        self.close()


class Recorder:
    """Turns each step's loss, gradient norm and time into :class:`StepMetrics` on every rank (the peak memory
    is a collective) and hands them to rank 0's :class:`MetricsLog`."""

    def __init__(
        self, log: MetricsLog, device: torch.device, *, flops_per_step: float, amount: int, peak_flops: float
    ) -> None:
        self.log = log
        self.device = device
        self.flops_per_step = flops_per_step
        """Model FLOPs of one step (forward and backward of the global batch)."""
        self.amount = amount
        """Tokens (or samples) of one step."""
        self.peak_flops = peak_flops
        """FLOP/s of every device of the job together."""

    def step(
        self, step: int, loss: float, grad_norm: float, lr: float, seconds: float, *, balance_loss: float = 0.0
    ) -> StepMetrics:
        rate = 1 / max(seconds, 1e-9)
        metrics = StepMetrics(
            step=step, loss=loss, grad_norm=grad_norm, lr=lr, step_seconds=seconds, per_second=self.amount * rate,
            mfu=self.flops_per_step * rate / self.peak_flops, peak_memory=every_peak_memory(self.device),
            balance_loss=balance_loss,
        )  # fmt: skip
        self.log.step(metrics)
        return metrics

    def evaluation(self, step: int, loss: float) -> EvalMetrics:
        metrics = EvalMetrics(step, loss)
        self.log.evaluation(metrics)
        return metrics
