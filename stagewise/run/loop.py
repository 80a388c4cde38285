"""The training job run on every rank: its data, the steps of its Pipeline (see :mod:`.job_pipeline`), evaluation,
checkpoints and metrics."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from stagewise import checkpoint
from stagewise.pipeline import (
    Batch,
    LoaderOptions,
    Pipeline,
    StageLoader,
)
from stagewise.run.config import TrainConfig
from stagewise.run.job_pipeline import TRAINING, VALIDATION, assembled, datasets, named_split
from stagewise.run.metrics import Destinations, MetricsLog, Recorder, matmul_peak
from stagewise.run.resume import Start, release, starting_point
from stagewise.run.stopping import StopSignal, StopSignals
from stagewise.run.user_model import model_of

log = logging.getLogger(__name__)


@dataclass
class Summary:
    """What a run did: per-step losses and times, evaluations, and where its outputs are."""

    config: dict[str, Any]
    partition: list[int]
    """The stage boundaries chosen by the partitioner."""
    parameters: int
    """Parameters of the unsplit model (a tied one once)."""
    first_step: int
    """The step this run started from (above 0 when resumed)."""
    losses: list[float] = field(default_factory=list)
    step_seconds: list[float] = field(default_factory=list)
    evals: list[tuple[int, float]] = field(default_factory=list)
    """(step, validation loss) pairs."""
    samples_per_step: int = 0
    tokens_per_sample: int = 1
    checkpoint: str | None = None
    """The last checkpoint written."""
    skipped: list[int] = field(default_factory=list)
    """Steps skipped for a non-finite loss."""
    stopped: StopSignal | None = None
    """The signal that ended the run at the end of a step, before its last (see :class:`StopSignals`)."""

    def throughput(self) -> float:
        """Tokens (or samples) per second over the run's steps after the first."""
        timed = self.step_seconds[1:] or self.step_seconds
        return self.samples_per_step * self.tokens_per_sample * len(timed) / max(sum(timed), 1e-9)


StepCallback = Callable[[int, float, float], None]
"""``callback(step, loss, seconds)`` after each step, on every rank."""


def _optimizer(config: TrainConfig, pipe: Pipeline) -> torch.optim.Optimizer:
    params = list(pipe.parameters())
    if config.optimizer == "sgd":
        return torch.optim.SGD(params, lr=config.lr, momentum=0.9)
    return torch.optim.AdamW(params, lr=config.lr, weight_decay=0.01)


def learning_rate(config: TrainConfig, step: int) -> float:
    """Linear warm-up to ``lr``, then a cosine down to ``lr / 10`` at the last step."""
    if step < config.warmup:
        return config.lr * (step + 1) / config.warmup
    span = max(1, config.steps - config.warmup)
    progress = min(1.0, (step - config.warmup) / span)
    return config.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def _batches(loader: StageLoader, start: checkpoint.Progress) -> Iterator[tuple[int, int, Batch]]:
    """(epoch, index in epoch, batch) forever, from the position ``start``."""
    epoch, first = start.epoch, start.batch
    while True:
        loader.set_epoch(epoch, start=first)
        for offset, batch in enumerate(loader):
            yield epoch, first + offset, batch
        epoch, first = epoch + 1, 0


def _evaluate(pipe: Pipeline, loader: StageLoader, config: TrainConfig) -> float:
    losses = []
    pipe.eval()
    for _, batch in zip(range(config.eval_batches), loader, strict=False):
        losses.append(float(pipe.evaluate(batch.inputs, batch.targets)))
    pipe.train()
    return sum(losses) / len(losses)


def _due(done: int, end: int, every: int) -> bool:
    """Whether a periodic action (every ``every`` steps, and at the end; 0: only at the end) falls after ``done``."""
    return done == end or (every > 0 and done % every == 0)


@dataclass(frozen=True)
class _Stepped:
    loss: float
    grad_norm: float
    """The gradients' global norm before clipping; NaN for a step skipped for a non-finite loss."""
    balance_loss: float
    """The mixture-of-experts layers' load-balancing loss, included in ``loss`` (0 without)."""


def _train_step(
    pipe: Pipeline, optimizer: torch.optim.Optimizer, config: TrainConfig, step: int, batch: Batch, *, traced: bool
) -> _Stepped:
    """Step ``step``: its learning rate, forward and backward, clipping and the update (unless the pipeline
    skipped it for a non-finite loss); the loss and the gradients' norm. ``traced``: write the step's Chrome
    trace."""
    for group in optimizer.param_groups:
        group["lr"] = learning_rate(config, step)
    optimizer.zero_grad(set_to_none=True)
    # The step's trace only: the evaluation after it must not overwrite it.
    with pipe.tracing(config.trace if traced else None):
        loss = float(pipe.step(batch.inputs, batch.targets))
    norm = math.nan
    if not pipe.skipped:
        norm = float(pipe.clip_grad_norm_(config.clip if config.clip > 0 else math.inf))  # inf: measured, not clipped
        optimizer.step()
    balance = float(pipe.balance_loss) if pipe.balance_loss is not None else 0.0
    return _Stepped(loss, norm, balance)


def train(
    config: TrainConfig,
    *,
    on_start: Callable[[Pipeline], None] | None = None,
    on_step: StepCallback | None = None,
    stop: StopSignals | None = None,
) -> Summary:
    """Run ``config`` on this rank of a job started by torchrun or :func:`stagewise.comm.launch`.

    ``on_start(pipe)`` runs once the pipeline is built; ``on_step(step, loss,
    seconds)`` after every step. Returns this rank's :class:`Summary` (the
    losses are the global batch's on every rank). With ``stop``, a signal it
    caught on any rank ends the run after the step it arrived in, with a
    checkpoint there (when the run writes any); ``Summary.stopped`` names it.

    Where it starts, afresh or from a checkpoint, is :func:`~stagewise.run.resume.starting_point`'s choice. A
    restart that finds its job's checkpoint at the last step trains nothing: it evaluates, and returns a
    Summary without steps.
    """
    torch.manual_seed(config.seed)
    built = assembled(config)
    pipe = built.pipe
    if on_start is not None:
        on_start(pipe)
    model_config = model_of(config.model)
    train_data, val_data = datasets(config, model_config)
    with named_split(TRAINING):
        loader = StageLoader.of(
            pipe, train_data, global_batch_size=config.batch_size, options=LoaderOptions(seed=config.seed)
        )
    # Built now, so that a validation split too small for one batch fails before training, not after it.
    with named_split(VALIDATION):
        val_loader = StageLoader.of(
            pipe, val_data, global_batch_size=config.batch_size, options=LoaderOptions(shuffle=False)
        )
    optimizer = _optimizer(config, pipe)
    start = starting_point(config, pipe, optimizer)
    saver = (
        checkpoint.Checkpointer(config.checkpoint_dir, pipe, asynchronous=config.checkpoint_async)
        if config.checkpoint_dir is not None
        else None
    )
    try:
        with _metrics_log(config, pipe) as log:
            recorder = Recorder(
                log, pipe.mesh.device, flops_per_step=built.flops_per_sample * config.batch_size,
                amount=config.batch_size * config.tokens_per_sample, peak_flops=_peak_flops(config, pipe),
            )  # fmt: skip
            run = _Run(config, pipe, optimizer, loader, val_loader, start, saver, recorder)
            return _trained(run, on_step, stop)
    finally:
        try:
            if saver is not None:
                saver.close()  # the save in flight completes (or raises its failure) before the run ends
        finally:
            release(start)


def _metrics_log(config: TrainConfig, pipe: Pipeline) -> MetricsLog:
    """Rank 0's sinks for the run's metrics, as ``config`` names them."""
    where = Destinations(
        jsonl=Path(config.metrics) if config.metrics else None,
        tensorboard=Path(config.tensorboard) if config.tensorboard else None,
        wandb=Path(config.wandb) if config.wandb else None,
    )
    return MetricsLog(where, asdict(config), writer=pipe.mesh.rank == 0)


def _peak_flops(config: TrainConfig, pipe: Pipeline) -> float:
    """The job's devices' FLOP/s together: this rank's matmul, measured, times the world size."""
    on_gpu = pipe.mesh.device.type == "cuda"
    dtype = torch.bfloat16 if config.bf16 and on_gpu else torch.float32
    return matmul_peak(pipe.mesh.device, dtype, size=4096 if on_gpu else 512) * pipe.mesh.layout.world_size


@dataclass
class _Run:
    """What a run's steps use."""

    config: TrainConfig
    pipe: Pipeline
    optimizer: torch.optim.Optimizer
    loader: StageLoader
    val_loader: StageLoader
    start: Start
    saver: checkpoint.Checkpointer | None
    recorder: Recorder


def _trained(run: _Run, on_step: StepCallback | None, stop: StopSignals | None) -> Summary:
    """The steps from the run's start to its end, with its checkpoints, evaluations and metrics."""
    config, pipe = run.config, run.pipe
    position, found = run.start.position, run.start.checkpoint
    model_config = model_of(config.model)
    params = sum(p.numel() for p in model_config.build(device="meta").parameters())  # a tie counts once
    summary = Summary(asdict(config), list(pipe.partition.bounds), params, position.step)
    summary.samples_per_step, summary.tokens_per_sample = config.batch_size, config.tokens_per_sample
    batches = _batches(run.loader, position)
    end = config.steps if config.stop_after is None else config.stop_after
    for step in range(position.step, end):
        epoch, index, batch = next(batches)
        began = time.perf_counter()
        stepped = _train_step(pipe, run.optimizer, config, step, batch, traced=step == end - 1)
        if pipe.skipped:
            summary.skipped.append(step + 1)
        seconds = time.perf_counter() - began
        summary.losses.append(stepped.loss)
        summary.step_seconds.append(seconds)
        done = step + 1
        run.recorder.step(
            done, stepped.loss, stepped.grad_norm, learning_rate(config, step), seconds,
            balance_loss=stepped.balance_loss,
        )  # fmt: skip
        if on_step is not None:
            on_step(done, stepped.loss, seconds)
        summary.stopped = stop.agreed(pipe.mesh.device) if stop is not None and done < end else None
        if run.saver is not None and (summary.stopped or _due(done, end, config.checkpoint_every)):
            wraps = index + 1 == run.loader.steps_per_epoch
            progress = checkpoint.Progress(
                done, epoch + 1 if wraps else epoch, 0 if wraps else index + 1, batch_size=config.batch_size,
                seed=config.seed, sample_length=config.tokens_per_sample,
            )  # fmt: skip
            summary.checkpoint = str(run.saver.save(run.optimizer, progress))
        if summary.stopped:
            break
        if _due(done, end, config.eval_every):
            summary.evals.append((done, _evaluated(run, done)))
    if position.step >= end:  # a restart after this job's last save (starting_point): only the evaluation is left
        summary.checkpoint = str(found)
        summary.evals.append((position.step, _evaluated(run, position.step)))
    return summary


def _evaluated(run: _Run, step: int) -> float:
    loss = _evaluate(run.pipe, run.val_loader, run.config)
    run.recorder.evaluation(step, loss)
    return loss
