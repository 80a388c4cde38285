"""The training job run on every rank: the model (a preset or the user's), its data, the Pipeline, evaluation and
checkpoints."""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

from stagewise import checkpoint
from stagewise.comm import init_mesh
from stagewise.models import CNNConfig, GPTConfig, MLPConfig, ModelConfig, gpt_parallel
from stagewise.models.synthetic import pattern_images, teacher_regression
from stagewise.partition import Layer, Partition, balance, balance_costs, layers_of, profile, shared_parameters
from stagewise.partition.call_spec import Inputs
from stagewise.partition.segment import Segment
from stagewise.pipeline import (
    Batch,
    Compute,
    DataParallel,
    FullySharded,
    LoaderOptions,
    Loss,
    Pipeline,
    PipelineOptions,
    SelectiveCheckpointing,
    StageLoader,
    WeightGradientFusion,
    load_pretrained,
)
from stagewise.pipeline.assembly import checked_schedule
from stagewise.pipeline.loss.routing import routed_layers
from stagewise.plan.balanced_moe import balanced_routing
from stagewise.run.config import TrainConfig
from stagewise.run.data import language_splits
from stagewise.run.metrics import Destinations, MetricsLog, Recorder, matmul_peak
from stagewise.run.objective import objective
from stagewise.run.resume import Start, release, starting_point
from stagewise.run.stopping import StopSignal, StopSignals
from stagewise.run.user_model import UserModel, model_of
from stagewise.schedule import Schedule, ScheduleName

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


def _datasets(config: TrainConfig, model: ModelConfig | UserModel) -> tuple[Dataset[Any], Dataset[Any]]:
    """Training and validation data for the model."""
    if isinstance(model, (GPTConfig, UserModel)):
        if isinstance(model, GPTConfig) and config.seq_len > model.seq_len:
            raise ValueError(f"seq_len={config.seq_len} exceeds {config.model}'s longest sequence, {model.seq_len}")
        return language_splits(config)
    n = 64 * config.batch_size
    if isinstance(model, MLPConfig):
        return teacher_regression(model, n, seed=1), teacher_regression(model, n // 8, seed=2)
    assert isinstance(model, CNNConfig)
    return pattern_images(model, n, seed=1), pattern_images(model, n // 8, seed=2)


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


TRAINING, VALIDATION = "the training split", "the validation split (the data held out)"
"""What a loader's refusal names: the data it was given."""


@contextlib.contextmanager
def _named(split: str) -> Iterator[None]:
    """Within, a refusal (a loader's) says which split it refused."""
    try:
        yield
    except ValueError as err:
        raise ValueError(f"{split}: {err}") from err


def preflight(config: TrainConfig) -> None:
    """What :func:`train` would refuse in ``config`` before its first step, checked in this process alone: the
    model's layers against the stages, the schedule, the data and the batches. A launcher calls it before it
    starts any process, so a bad value is one message rather than a traceback from every rank."""
    model_config = model_of(config.model)
    model = _meta_model(config, model_config)
    layers = layers_of(model)
    if config.tp > 1:
        _check_tensor_parallel(config, model_config, model, layers)
    if config.ep > 1:
        _check_expert_parallel(config, model)
    n_stages = config.pp * config.virtual
    part = (
        Partition.from_bounds(config.partition)
        if config.partition is not None
        else balance([1.0] * len(layers), n_stages)
    )
    checked_schedule(
        layers, part, schedule_of(config), config.microbatches, loss_fn=objective(model_config).loss_fn,
        options=pipeline_options(config),
    )  # fmt: skip
    train_data, val_data = _datasets(config, model_config)
    for split, data, shuffle in ((TRAINING, train_data, True), (VALIDATION, val_data, False)):
        with _named(split):
            StageLoader(
                data, global_batch_size=config.batch_size, dp=config.batch_shards, replica=0, first=False, last=False,
                n_microbatches=config.microbatches, options=LoaderOptions(shuffle=shuffle),
            )  # fmt: skip


def _check_tensor_parallel(
    config: TrainConfig, model_config: ModelConfig | UserModel, model: nn.Module, layers: list[Layer]
) -> None:
    """Refuse ``tp > 1`` for a model without a tensor-parallel plan, or one the plan cannot split ``tp`` ways: a
    GPT preset by its own plan, a Hugging Face model by its config's (``tp_plan``), checked on its captured layers."""
    if isinstance(model_config, GPTConfig):
        for layer in layers:
            gpt_parallel.plan(layer.name, layer.module, config.tp)  # raises, saying which tp would fit
        return
    if not isinstance(model_config, UserModel):
        raise ValueError(
            f"tp={config.tp}: tensor parallelism splits GPT presets' layers and Hugging Face models by their "
            f"config's tp_plan, and {config.model} is neither; train it with tp=1 (fsdp shards any model)"
        )
    from stagewise.pipeline.parallel.captured_tensor_parallel import segment_split  # DTensor: only for tp > 1
    from stagewise.pipeline.parallel.tensor_plan import path_plan

    plan = path_plan("model", model)  # raises where the model has no plan, naming the fix
    for layer in layers:
        if isinstance(layer.module, Segment):
            segment_split(layer.module, layer.name, plan, config.tp)  # raises what tp does not divide


def _check_expert_parallel(config: TrainConfig, model: nn.Module) -> None:
    """Refuse ``ep > 1`` for a model without mixture-of-experts layers, or one whose experts ``ep`` does not divide."""
    layers = routed_layers([model])
    if not layers:
        raise ValueError(
            f"ep={config.ep} splits mixture-of-experts layers' experts over ranks, but {config.model} has none; "
            "leave ep at 1 (no --ep), or train a mixture of experts (gpt-moe-tiny)"
        )
    for layer in layers:
        if layer.num_experts % config.ep:
            raise ValueError(
                f"ep={config.ep} does not divide the {layer.num_experts} experts of {config.model}'s "
                f"mixture-of-experts layers; choose ep among the divisors of {layer.num_experts}"
            )


def _micro(config: TrainConfig) -> int:
    """Samples in one micro-batch of one share of the batch (at least 1)."""
    return max(1, config.batch_size // config.batch_shards // config.microbatches)


def _meta_model(config: TrainConfig, model_config: ModelConfig | UserModel) -> nn.Module:
    """``config``'s model on the meta device: a preset as it is, the user's model captured as a chain."""
    if isinstance(model_config, UserModel):
        return model_config.chain(_micro(config), config.seq_len, packed=config.document_masking)
    return model_config.build(device="meta")


def _sample(config: TrainConfig, model_config: ModelConfig | UserModel, micro: int) -> Inputs:
    """One micro-batch as the model takes it, for profiling on the meta device."""
    if isinstance(model_config, UserModel):
        return model_config.example(micro, config.seq_len, packed=config.document_masking)
    if isinstance(model_config, GPTConfig) and config.document_masking:
        return model_config.packed_example(micro, config.seq_len)
    return model_config.example(micro, config.seq_len if config.tokens_per_sample > 1 else None)


@dataclass(frozen=True)
class _Assembled:
    """A rank's pipeline, and what the run measures against."""

    pipe: Pipeline
    flops_per_sample: float
    """The model's forward and backward FLOPs for one sample (recomputation not counted)."""


def build_pipeline(config: TrainConfig) -> Pipeline:
    """The Pipeline of ``config`` on this rank: the model on the meta device, split exactly by FLOPs; a Hugging
    Face folder's weights are read per stage."""
    return _assembled(config).pipe


def _assembled(config: TrainConfig) -> _Assembled:
    mesh = init_mesh(config.pp, config.dp, fsdp=config.fsdp, tp=config.tp, ep=config.ep, timeout=config.timeout)
    model_config = model_of(config.model)
    model = _meta_model(config, model_config)
    n_stages = config.pp * config.virtual
    micro = _micro(config)
    with balanced_routing(model):  # a mixture of experts cannot route meta tensors: costed with balanced routing
        costs = profile(model, _sample(config, model_config, micro))  # on meta: FLOPs, for the split and the MFU
    part: Partition = (
        Partition.from_bounds(config.partition)
        if config.partition is not None
        else balance_costs(costs, n_stages, by="flops", shared=shared_parameters(layers_of(model)))
    )
    pipe = Pipeline(
        model,
        part,
        schedule=schedule_of(config),
        n_microbatches=config.microbatches,
        loss_fn=objective(model_config).loss_fn,
        mesh=mesh,
        options=pipeline_options(config),
    )
    weights = model_config.weights if isinstance(model_config, UserModel) else None
    if weights is not None:
        load_pretrained(pipe, weights)
    return _Assembled(pipe, sum(c.flops for c in costs) / micro)


def schedule_of(config: TrainConfig) -> ScheduleName | Schedule:
    """The schedule ``config`` trains: its :attr:`~TrainConfig.schedule_text` read, else its schedule's name."""
    if config.schedule_text is None:
        return config.schedule
    return Schedule.from_text(config.schedule_text, name="planned")


def pipeline_options(config: TrainConfig) -> PipelineOptions:
    """The rarer knobs of ``config``'s Pipeline; its loss reduction is its model's (:func:`objective`)."""
    fusion = (
        WeightGradientFusion(pool=config.weight_gradient_pool)
        if config.weight_gradient_fusion
        else WeightGradientFusion.off()
    )
    model_config = model_of(config.model)
    goal = objective(model_config)
    return PipelineOptions(
        n_virtual=config.virtual,
        seed=config.seed,
        loss=Loss(reduction=goal.reduction, ignore_index=goal.ignore_index, nonfinite=config.nonfinite),
        compute=Compute(
            autocast=torch.bfloat16 if config.bf16 else None,
            activation_checkpointing=(
                SelectiveCheckpointing()
                if config.activation_checkpointing == "selective"
                else config.activation_checkpointing is True
            ),
            offload_activations=config.offload_activations,
            compile=config.compile,
        ),
        fuse_weight_gradients=fusion,
        fully_sharded=(
            FullySharded(gather=config.fsdp_gather, offload=config.offload_optimizer)
            if config.fsdp_gather != "step" or config.offload_optimizer
            else "auto"
        ),
        data_parallel=DataParallel(),
        tensor_parallel=(
            gpt_parallel.plan
            if isinstance(model_config, GPTConfig)
            else "model"
            if isinstance(model_config, UserModel) and config.tp > 1
            else None
        ),
    )


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
    built = _assembled(config)
    pipe = built.pipe
    if on_start is not None:
        on_start(pipe)
    model_config = model_of(config.model)
    train_data, val_data = _datasets(config, model_config)
    with _named(TRAINING):
        loader = StageLoader.of(
            pipe, train_data, global_batch_size=config.batch_size, options=LoaderOptions(seed=config.seed)
        )
    # Built now, so that a validation split too small for one batch fails before training, not after it.
    with _named(VALIDATION):
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
