"""The Pipeline a training job describes: the checks before any process starts, the model on the meta device, its
partition and schedule, and the options the job's settings make."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

from stagewise.comm import init_mesh
from stagewise.models import CNNConfig, GPTConfig, MLPConfig, ModelConfig, gpt_parallel
from stagewise.models.synthetic import pattern_images, teacher_regression
from stagewise.partition import Layer, Partition, balance, balance_costs, layers_of, profile, shared_parameters
from stagewise.partition.call_spec import Inputs
from stagewise.partition.segment import Segment
from stagewise.pipeline import (
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
from stagewise.run.objective import objective
from stagewise.run.user_model import UserModel, model_of
from stagewise.schedule import Schedule, ScheduleName

log = logging.getLogger(__name__)


def datasets(config: TrainConfig, model: ModelConfig | UserModel) -> tuple[Dataset[Any], Dataset[Any]]:
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


TRAINING, VALIDATION = "the training split", "the validation split (the data held out)"
"""What a loader's refusal names: the data it was given."""


@contextlib.contextmanager
def named_split(split: str) -> Iterator[None]:
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
    train_data, val_data = datasets(config, model_config)
    for split, data, shuffle in ((TRAINING, train_data, True), (VALIDATION, val_data, False)):
        with named_split(split):
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
class Assembled:
    """A rank's pipeline, and what the run measures against."""

    pipe: Pipeline
    flops_per_sample: float
    """The model's forward and backward FLOPs for one sample (recomputation not counted)."""


def build_pipeline(config: TrainConfig) -> Pipeline:
    """The Pipeline of ``config`` on this rank: the model on the meta device, split exactly by FLOPs; a Hugging
    Face folder's weights are read per stage."""
    return assembled(config).pipe


def assembled(config: TrainConfig) -> Assembled:
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
    return Assembled(pipe, sum(c.flops for c in costs) / micro)


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
