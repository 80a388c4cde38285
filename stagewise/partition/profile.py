"""profile(): per-layer parameters, FLOPs, activation bytes and time, one layer at a time."""

from __future__ import annotations

import copy
import logging
import statistics
import time as clock
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import FlopCounterMode
from tqdm import tqdm

from stagewise.partition.attention import FLOP_FORMULAS, FusedAttentionOnMeta
from stagewise.partition.call_spec import Inputs, positional_inputs
from stagewise.partition.layer_cost import LayerCost
from stagewise.partition.layers import Layer, Payload, layers_of
from stagewise.partition.linears import DEFAULT_MIN_POOLED_ELEMENTS, LINEAR_OPS
from stagewise.partition.live_bytes import LiveBytes
from stagewise.partition.segment import Segment
from stagewise.partition.selective import RecomputeClock, SelectiveCount

log = logging.getLogger(__name__)


def _tensors(value: object, where: str) -> tuple[torch.Tensor, ...]:
    if isinstance(value, torch.Tensor):
        return (value,)
    if isinstance(value, tuple) and all(isinstance(v, torch.Tensor) for v in value):
        return value
    raise TypeError(
        f"{where} must be a tensor or a tuple of tensors, got {type(value).__name__}; "
        "layers of a chain pass tensors to each other"
    )


def _like(value: Payload, fn: Callable[[torch.Tensor], torch.Tensor]) -> Payload:
    return fn(value) if isinstance(value, torch.Tensor) else tuple(fn(v) for v in value)


def _fresh(value: Payload, *, first: bool = False, copy: bool = False) -> Payload:
    """A stage-boundary input: detached, and requiring grad where it is floating point.

    The first layer's input is the data, which asks for a gradient only where the sample does: a pipeline
    computes no gradient of its inputs, so neither its FLOPs nor its time count one. With ``copy``, a tensor
    that requires grad comes as a copy of the leaf, which a layer may change in place (as ``Pipeline`` runs a
    stage that does).
    """

    def fresh(t: torch.Tensor) -> torch.Tensor:
        leaf = t.detach().requires_grad_(t.requires_grad if first else t.is_floating_point())
        return leaf.clone() if copy and leaf.requires_grad else leaf

    return _like(value, fresh)


def _changes_its_input(work: nn.Module, inputs: Payload) -> bool:
    """Whether ``work`` changes its input in place (``ReLU(inplace=True)``), which autograd refuses on a leaf: a
    forward, whose graph is dropped."""
    if not any(t.requires_grad for t in _tensors(inputs, "sample")):
        return False
    try:
        work(inputs)
    except RuntimeError as err:
        if "leaf Variable that requires grad is being used in an in-place operation" in str(err):
            return True
        raise
    return False


def _on(target: torch.device) -> Callable[[torch.Tensor], torch.Tensor]:
    """Moves a sample tensor to ``target``; a meta one (no values) becomes zeros of its shape there."""

    def move(t: torch.Tensor) -> torch.Tensor:
        if t.is_meta and target.type != "meta":
            return torch.zeros_like(t, device=target)
        return t.to(target)

    return move


def _backward(output: Payload) -> None:
    outs = [t for t in _tensors(output, "output") if t.requires_grad]
    if outs:
        torch.autograd.backward(outs, [torch.ones_like(t) for t in outs])


class _PooledBytes(TorchFunctionMode):
    """Adds up what backwards keep for weight gradients computed later: the input and output bytes of each linear
    op whose weight a pooled backward keeps them for (``total``), and the output bytes of every other op that
    reads a parameter (``uses``), whose gradients zero-bubble's input pass keeps for its weight pass."""

    def __init__(self, min_elements: int) -> None:
        super().__init__()
        self.min_elements = min_elements
        self.total = 0
        self.uses = 0
        self.inputs = 0
        """The pooled linears' input bytes (of ``total``)."""
        self.largest: list[int] = []
        """The two largest pooled linears' input and output bytes, largest first."""

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Iterable[type],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not torch.is_grad_enabled():
            return out
        if func in LINEAR_OPS:
            x = args[0] if args else kwargs["input"]
            w = args[1] if len(args) > 1 else kwargs["weight"]
            if isinstance(w, nn.Parameter) and w.requires_grad and w.numel() >= self.min_elements:
                size = x.numel() * x.element_size() + out.numel() * out.element_size()
                self.total += size
                self.inputs += x.numel() * x.element_size()
                self.largest = sorted([*self.largest, size], reverse=True)[:2]
                return out
        if any(isinstance(a, nn.Parameter) and a.requires_grad for a in tree_leaves((args, kwargs))):
            self.uses += sum(t.numel() * t.element_size() for t in tree_leaves(out) if _needs_grad(t))
        return out


def _needs_grad(value: object) -> bool:
    return isinstance(value, torch.Tensor) and value.requires_grad


class _SavedBytes:
    """Saved-tensor hooks that add up the distinct storages autograd keeps, parameters excluded."""

    def __init__(self, module: nn.Module, clock: Callable[[], int] | None = None) -> None:
        self.held = {t.untyped_storage() for t in (*module.parameters(), *module.buffers())}
        self.storages: dict[torch.UntypedStorage, int] = {}
        self.clock = clock
        """Reads the FLOPs counted so far."""
        self.last_pack = 0
        """The FLOPs counted when the last tensor (parameters too) was saved: what checkpointing recomputes."""

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.clock is not None:
            self.last_pack = self.clock()
        storage = tensor.untyped_storage()
        if storage not in self.held:
            self.storages[storage] = storage.nbytes()
        return tensor

    @staticmethod
    def unpack(tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    @property
    def total(self) -> int:
        return sum(self.storages.values())


def _device_of(module: nn.Module) -> torch.device | None:
    for tensor in (*module.parameters(), *module.buffers()):
        return tensor.device
    return None


def working_copy(module: nn.Module, device: torch.device) -> nn.Module:
    """A private copy of ``module`` on ``device``, as profiling runs each layer; a meta module gets fresh values."""
    work = copy.deepcopy(module)
    if _device_of(module) == torch.device("meta") and device.type != "meta":
        work.to_empty(device=device)
        with torch.no_grad():
            for tensor in (*work.parameters(), *work.buffers()):
                if tensor.is_floating_point():
                    tensor.normal_(0.0, 0.02)
                else:
                    tensor.zero_()
        for sub in work.modules():
            reset = getattr(sub, "reset_parameters", None)
            if callable(reset):
                reset()
    else:
        work.to(device)
    return work


@dataclass(frozen=True)
class _Timed:
    """A layer's measured seconds: a forward and backward, and what selective checkpointing recomputes."""

    step: float
    recompute: float


def _time(
    work: nn.Module, inputs: Payload, device: torch.device, warmup: int, repeats: int, *, first: bool, copy: bool
) -> _Timed:
    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    samples = []
    for i in range(warmup + repeats):
        work.zero_grad(set_to_none=True)
        x = _fresh(inputs, first=first, copy=copy)
        sync()
        start = clock.perf_counter()
        _backward(work(x))
        sync()
        if i >= warmup:
            samples.append(clock.perf_counter() - start)
    recomputed = []
    for _ in range(repeats):
        with torch.no_grad(), RecomputeClock(sync) as timer:
            work(_fresh(inputs, first=first, copy=copy))
        recomputed.append(timer.seconds)
    return _Timed(statistics.median(samples), statistics.median(recomputed))


def _choose_device(layers: Sequence[Layer], time: bool, device: torch.device | str | None) -> torch.device:
    if device is not None:
        chosen = torch.device(device)
    else:
        found = [d for d in (_device_of(layer.module) for layer in layers) if d is not None]
        real = [d for d in found if d.type != "meta"]
        if time:
            chosen = real[0] if real else torch.device("cpu")
        else:
            chosen = torch.device("meta") if any(d.type == "meta" for d in found) or not found else found[0]
    if time and chosen.type == "meta":
        raise ValueError("measuring time needs a real device; pass device='cpu' or 'cuda', or time=False")
    return chosen


def profile(
    model: nn.Module | Sequence[Layer],
    sample: Inputs,
    *,
    time: bool = False,
    device: torch.device | str | None = None,
    warmup: int = 2,
    repeats: int = 5,
    progress: bool = False,
    pooled_min_elements: int = DEFAULT_MIN_POOLED_ELEMENTS,
) -> list[LayerCost]:
    """The cost of each layer of a chain for one micro-batch ``sample`` of its input.

    Layers run one at a time, in order, each on a private copy so the model
    itself is never changed (no ``.grad``, no running-statistics update) and
    peak memory is one layer. Each layer's input is the previous layer's output.

    Without ``time``, a model on the meta device is profiled on the meta
    device: parameters, FLOPs and activation bytes of a 7B-parameter model
    come out without allocating it. With ``time=True`` each layer is made real
    on ``device`` (meta layers are materialised and initialised one at a
    time), and its forward plus backward is timed: ``warmup`` runs, then the
    median of ``repeats``.

    Args:
        model: a chain (see :func:`layers_of`) or its layers.
        sample: one micro-batch of the model's input (by keyword for a model captured so); on the meta device
            it stands for zeros of its shape where the layers run on a real one. It counts no gradient of its
            own unless it requires one.
        time: measure forward plus backward time.
        device: where to run; by default where the model is (meta without
            ``time``; for ``time``, the model's real device or the CPU).
        progress: show a progress bar on stderr.
        pooled_min_elements: the smallest linear weight whose gradient is
            pooled (``WeightGradientFusion.min_pooled_elements``), for
            :attr:`LayerCost.pooled_bytes`.
    """
    layers = layers_of(model) if isinstance(model, nn.Module) else list(model)
    if not layers:
        raise ValueError("there are no layers to profile")
    sample = positional_inputs(model, sample)
    if warmup < 0 or repeats < 1:
        raise ValueError(f"need warmup >= 0 and repeats >= 1, got warmup={warmup}, repeats={repeats}")
    settings = _Settings(_choose_device(layers, time, device), time, warmup, repeats, pooled_min_elements)
    _tensors(sample, "sample")
    current: Payload = _like(sample, _on(settings.device))
    costs: list[LayerCost] = []
    kept_outputs: list[bool] = []
    for index, layer in enumerate(tqdm(layers, desc="profiling", disable=not progress, unit="layer")):
        cost, current, kept_outputs = _profile_layer(layer, current, kept_outputs, settings, first=index == 0)
        costs.append(cost)
        log.debug("profiled %s: %s", layer.name, cost)
    return costs


@dataclass(frozen=True)
class _Settings:
    """How :func:`profile` runs each layer."""

    device: torch.device
    time: bool
    warmup: int
    repeats: int
    pooled_min_elements: int


def _profile_layer(
    layer: Layer, current: Payload, kept_outputs: list[bool], settings: _Settings, *, first: bool
) -> tuple[LayerCost, Payload, list[bool]]:
    """The cost of ``layer`` on ``current``, the previous layer's output (``kept_outputs``: which of its tensors
    that layer saved for backward); also the layer's output, detached, and which of its tensors it saved."""
    work = working_copy(layer.module, settings.device)
    # Training's costs; a segment captured in eval mode runs only as captured.
    work.train(work.captured_training if isinstance(work, Segment) else True)
    copy = _changes_its_input(work, _fresh(current, first=first))
    inputs = _fresh(current, first=first, copy=copy)
    in_storages = [t.untyped_storage() for t in _tensors(inputs, "sample")]
    run = _counted_run(work, inputs, layer.name, settings.pooled_min_elements)
    shared = sum(
        storage.nbytes()
        for storage, before in zip(in_storages, kept_outputs, strict=False)
        if before and storage in run.saved.storages
    )
    saves_output = [t.untyped_storage() in run.saved.storages for t in run.outs]
    elapsed = (
        _time(work, current, settings.device, settings.warmup, settings.repeats, first=first, copy=copy)
        if settings.time
        else None
    )
    cost = _layer_cost(layer, run, shared_bytes=shared, timed=elapsed)
    return cost, _like(run.output, lambda t: t.detach()), saves_output


@dataclass(frozen=True)
class _Run:
    """One forward and backward of a layer, counted."""

    output: Payload
    outs: tuple[torch.Tensor, ...]
    """The output's tensors."""
    flops: int
    forward_flops: int
    saved: _SavedBytes
    pooled: _PooledBytes
    working_bytes: int
    """What the layer held for a moment beyond what it saves (see :attr:`LayerCost.working_bytes`)."""
    selective: SelectiveCount
    """What selective activation checkpointing would keep and recompute of its forward."""


def _counted_run(work: nn.Module, inputs: Payload, name: str, pooled_min_elements: int) -> _Run:
    """Run ``work`` forward and backward on ``inputs`` once, counting FLOPs, saved, pooled and live bytes."""
    pooled, live, selective = _PooledBytes(pooled_min_elements), LiveBytes(), SelectiveCount()
    with FlopCounterMode(display=False, custom_mapping=FLOP_FORMULAS) as counter:
        saved = _SavedBytes(work, clock=counter.get_total_flops)
        hooks = torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack)
        with hooks, FusedAttentionOnMeta(), pooled, live, selective:
            output = work(inputs)
        outs = _tensors(output, f"the output of layer {name!r}")
        forward_flops = counter.get_total_flops()
        kept = live.current  # what the forward leaves: the saved tensors and the output
        forward_extra, live.peak = live.peak - kept, kept
        with live:
            _backward(output)
        total_flops = counter.get_total_flops()
    grads = sum(p.grad.untyped_storage().nbytes() for p in work.parameters() if p.grad is not None)
    working = max(forward_extra, live.peak - kept - grads, 0)
    return _Run(output, outs, int(total_flops), int(forward_flops), saved, pooled, int(working), selective)


def _layer_cost(layer: Layer, run: _Run, *, shared_bytes: int, timed: _Timed | None) -> LayerCost:
    """What ``layer`` costs: its parameters and buffers, and what ``run`` counted."""
    params = list(layer.module.parameters())
    return LayerCost(
        name=layer.name,
        params=sum(p.numel() for p in params),
        param_bytes=sum(p.numel() * p.element_size() for p in params),
        buffer_bytes=sum(b.numel() * b.element_size() for b in layer.module.buffers()),
        flops=run.flops,
        forward_flops=run.forward_flops,
        output_bytes=sum(t.numel() * t.element_size() for t in run.outs),
        saved_bytes=run.saved.total,
        time=None if timed is None else timed.step,
        shared_bytes=shared_bytes,
        pooled_bytes=run.pooled.total,
        use_bytes=run.pooled.uses,
        pooled_input_bytes=run.pooled.inputs,
        flush_bytes=sum(run.pooled.largest),
        working_bytes=run.working_bytes,
        selective_bytes=run.selective.kept,
        recompute_flops=run.selective.recompute_flops,
        recompute_bytes=run.selective.recompute_bytes,
        checkpoint_flops=run.saved.last_pack,
        recompute_time=None if timed is None else timed.recompute,
    )
