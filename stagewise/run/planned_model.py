"""The model a plan costs, resolved as a run resolves it: a preset, ``hf:DIR``, or ``MODULE:FACTORY``.

Train and plan read a model's name the same way (:func:`~stagewise.run.user_model.model_of`): a preset, a
local Hugging Face folder, or a factory returning a language model, which takes token ids. A plan may also
cost a factory's model of another kind, given one sample's shape (``input_shape``): then it is built on the
meta device and the sample is checked against it before anything is profiled.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from stagewise.comm.payload import Payload
from stagewise.models import GPTConfig, ModelConfig
from stagewise.partition import Layer, layers_of
from stagewise.partition.profile import working_copy
from stagewise.run.user_model import UserModel, factory_of, model_of

log = logging.getLogger(__name__)

DEFAULT_SEQ_LEN = 128
"""Tokens per sample of a user's language model when the plan names none."""


@dataclass(frozen=True)
class ModelRequest:
    """Which model a plan costs, and on what."""

    name: str
    """A preset, ``hf:DIR`` or ``MODULE:FACTORY``."""
    micro_batch: int = 1
    """Samples of the profiled micro-batch."""
    seq_len: int | None = None
    """Tokens per sample of a language model; None: a preset's own, or :data:`DEFAULT_SEQ_LEN`."""
    input_shape: str | None = None
    """One sample's shape (``128``, ``3x32x32``) of a factory's model that takes no token ids; None: a factory
    returns a language model."""
    input_dtype: Literal["float32", "int64"] = "float32"
    """The dtype of that sample."""
    profile_on: torch.device | None = None
    """Where layer times are measured (``plan --profile``); None: costs from FLOPs on the meta device."""


@dataclass(frozen=True)
class PlannedModel:
    """A model on the meta device and one micro-batch as its first layer takes it."""

    model: nn.Module
    sample: Payload
    tokens_per_sample: int
    """Tokens in one sample: its length for a language model, else 1."""


def planned_model(request: ModelRequest) -> PlannedModel:
    """The model ``request`` names on the meta device, one profiled micro-batch, and tokens per sample."""
    resolved = model_of(request.name)
    if request.input_shape is not None and (not isinstance(resolved, UserModel) or resolved.folder is not None):
        takes = "token ids" if isinstance(resolved, UserModel | GPTConfig) else "its own input"
        raise ValueError(f"--input-shape applies to MODULE:FACTORY models; {request.name} knows its input ({takes})")
    if isinstance(resolved, UserModel):
        if request.input_shape is not None:
            return _module(request)
        seq_len = request.seq_len or DEFAULT_SEQ_LEN
        chain = resolved.chain(request.micro_batch, seq_len)
        return PlannedModel(chain, chain.call.positional(resolved.example(request.micro_batch, seq_len)), seq_len)
    return _preset(request, resolved)


def check_seq_len(seq_len: int | None, name: str, config: ModelConfig) -> None:
    """Refuse a sequence length for a preset that reads no sequences (every preset but the GPT ones)."""
    if seq_len is not None and not isinstance(config, GPTConfig):
        raise ValueError(f"--seq-len applies to the GPT presets; {name} takes no sequence: leave it out")


def _preset(request: ModelRequest, config: ModelConfig) -> PlannedModel:
    check_seq_len(request.seq_len, request.name, config)
    sample = config.example(request.micro_batch, request.seq_len)
    tokens = int(sample.shape[1]) if isinstance(config, GPTConfig) else 1
    return PlannedModel(config.build(device="meta"), sample, tokens)


def _module(request: ModelRequest) -> PlannedModel:
    """A factory's model of another kind than a language model, with a sample of ``request.input_shape``."""
    try:
        dims = [int(x) for x in str(request.input_shape).split("x")]
    except ValueError:
        dims = []
    if not dims or min(dims) < 1:
        raise ValueError(
            f"--input-shape {request.input_shape} is not one sample's shape: give sizes >= 1 such as 128 or 3x32x32"
        )
    shape = [request.micro_batch, *dims]
    with torch.device("meta"):
        model = factory_of(request.name)()
    if not isinstance(model, nn.Module):
        raise TypeError(f"{request.name} returned a {type(model).__name__}, not an nn.Module")
    dtype = torch.int64 if request.input_dtype == "int64" else torch.float32
    sample = torch.zeros(shape, dtype=dtype)
    _check_input(request, model, sample)
    return PlannedModel(model, sample, shape[1] if dtype == torch.int64 and len(shape) == 2 else 1)


_FAILURES = (RuntimeError, ValueError, TypeError, IndexError)
"""What a forward raises on an input it cannot take (NotImplementedError, a meta op missing, is a RuntimeError)."""


def _reason(err: BaseException) -> str:
    return str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__


def _check_input(request: ModelRequest, model: nn.Module, sample: torch.Tensor) -> None:
    """Refuse a micro-batch ``sample`` that the factory's ``model`` (on meta) cannot take, with the reason.

    The meta device computes shapes only, so a forward that reads its data (``.item()``, ``if tensor``,
    ``torch.nonzero``, boolean masks) fails there whatever the shape, with a RuntimeError like a wrong shape's:
    only their messages differ. A meta failure is therefore decided on a real device. When the plan profiles,
    the model's layers run there one at a time, as profiling runs them. Otherwise the plan costs on meta, which
    this model cannot pass anyway; only the layer that failed runs on the CPU, to say which of the two it was.
    """
    taken = f"a micro-batch of shape {list(sample.shape)} ({request.input_dtype})"
    try:  # on the meta device: shapes only, nothing computed
        with torch.no_grad():
            model(sample.to("meta"))
        return
    except _FAILURES as err:
        log.debug("%s on the meta device with %s: %s", request.name, taken, _reason(err))
    layers = layers_of(model)
    if request.profile_on is not None:
        _run_on(request.name, layers, sample, request.profile_on, taken)
        return
    current: Payload = sample.to("meta")
    for index, layer in enumerate(layers):
        try:
            with torch.no_grad():
                current = layer.module(current)
        except _FAILURES as err:
            _run_on(request.name, layers[index : index + 1], current, torch.device("cpu"), taken)
            raise ValueError(
                f"{request.name} takes {taken} on the CPU, but its layer {layer.name!r} cannot run on the meta "
                f"device: {_reason(err)}; its forward reads the data, which the meta device has not: add --profile "
                "to plan the model on a real device (--device)"
            ) from err
    # The model's forward failed on meta but its chain of layers, which the plan profiles, did not.


def _run_on(name: str, layers: Sequence[Layer], inputs: Payload, device: torch.device, taken: str) -> None:
    """Run ``layers`` one after another on ``device``, each a fresh copy as profiling makes it, from zeros shaped
    like ``inputs``; refuse the input shape with the reason when one fails."""
    current = _zeros(inputs, device)
    for layer in layers:
        work = working_copy(layer.module, device)
        try:
            with torch.no_grad():
                current = work(current)
        except _FAILURES as err:
            raise ValueError(
                f"{name} cannot take {taken}: {_reason(err)} (layer {layer.name!r} on {device}); give "
                "--input-shape as the shape of one sample the model takes"
            ) from err
        del work


def _zeros(payload: Payload, device: torch.device) -> Payload:
    """Zeros shaped like ``payload`` on ``device``: what a meta tensor stands for in profiling."""
    if isinstance(payload, torch.Tensor):
        return torch.zeros_like(payload, device=device)
    return tuple(torch.zeros_like(t, device=device) for t in payload)
