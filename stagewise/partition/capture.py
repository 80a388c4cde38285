"""capture(): a model that is not a chain, captured by torch.export and cut at its repeated blocks into a chain."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:  # torch.export imports dynamo: seconds, paid only when capturing
    from torch.export import Dim, ExportedProgram

from stagewise.partition.call_spec import CallSpec, Inputs, call_spec, chosen_output
from stagewise.partition.graph import CaptureError, SegmentGraph, cut
from stagewise.partition.hf_moe import refuse_eager_experts, router_logits_off
from stagewise.partition.layers import CHAIN_ATTRIBUTE, Layer, Payload, shared_parameters
from stagewise.partition.segment import Segment

log = logging.getLogger(__name__)

_CONTAINERS = (nn.Sequential, nn.ModuleList)


def repeated_blocks(model: nn.Module) -> list[str]:
    """The paths of the model's repeated blocks: the children of every ``nn.Sequential`` or
    ``nn.ModuleList`` with at least two children of one class (alternating dense and mixture-of-experts
    blocks too), outermost first (blocks inside a block are not listed)."""
    found: list[str] = []

    def visit(prefix: str, module: nn.Module) -> None:
        for name, child in module.named_children():
            path = f"{prefix}.{name}" if prefix else name
            kids = list(child.named_children())
            classes = Counter(type(c) for _, c in kids)
            if isinstance(child, _CONTAINERS) and classes and max(classes.values()) >= 2:
                found.extend(f"{path}.{k}" for k, _ in kids)
            else:
                visit(path, child)

    visit("", model)
    return found


class CapturedChain(nn.Module):
    """A model that is not a chain, as a chain of :class:`Segment`\\ s cut at its repeated blocks.

    It holds the captured model's modules under their own names, so its
    ``state_dict`` is the model's; running it runs the segments one after
    another and equals running the model. :func:`stagewise.partition.layers_of`
    returns its segments, so ``profile``, ``balance``, ``auto``,
    :class:`stagewise.Pipeline` and ``Partition.split_spec`` take it like any
    chain, and parameters keep the model's names.
    """

    def __init__(self, model: nn.Module, segments: Sequence[Segment], call: CallSpec) -> None:
        super().__init__()
        for name, child in model.named_children():
            self.add_module(name, child)
        keys = set(model.state_dict(keep_vars=True))
        for name, param in model.named_parameters(recurse=False):
            self.register_parameter(name, param)
        for name, buffer in model.named_buffers(recurse=False):
            self.register_buffer(name, buffer, persistent=name in keys)
        self.source = _Source(model)
        """The captured model (for ``torch.distributed.pipelining.pipeline()``, which traces it again with its own
        tracer)."""
        self.segments = list(segments)
        self.call = call
        """How the model takes its inputs (by keyword or position, which sizes), and checks a batch against it."""

    def stagewise_layers(self) -> list[Layer]:
        """The segments, as the layers of a chain; each names its parameters in full."""
        return [Layer(s.segment_name, s, prefix="") for s in self.segments]

    def train(self, mode: bool = True) -> CapturedChain:
        super().train(mode)
        for segment in self.segments:
            segment.train(mode)
        return self

    def forward(self, *args: torch.Tensor, **kwargs: torch.Tensor) -> Payload:
        """The model's output (the chosen entry, for a model that returns a mapping) on inputs given as the
        capture's example gave them."""
        if args and kwargs:
            raise TypeError(f"pass {self.call.model}'s inputs by keyword or by position, not both")
        x = self.call.positional(kwargs if kwargs else args)
        for segment in self.segments:
            x = segment(x)
        return x


_OWN_NAMES = frozenset(
    {"segment_name", "graph", "captured_on", "captured_training", "bare_output", "record", "source", "segments"}
    | {"call"}
    | {name for cls in (Segment, CapturedChain) for name in vars(cls) if not name.startswith("__")}
)
"""Attributes of segments and captured chains, which hold the model's own modules under their names."""


def _check_names(model: nn.Module) -> None:
    """Refuse a model whose top-level modules or tensors take a name the captured chain's pieces use themselves."""
    top = [name for name, _ in (*model.named_children(), *model.named_parameters(recurse=False))]
    top += [name for name, _ in model.named_buffers(recurse=False)]
    taken = sorted(set(top) & _OWN_NAMES)
    if taken:
        raise CaptureError(
            f"{type(model).__name__} has attributes named {taken}, which capture() keeps for the segments and the "
            f"chain it builds; rename them in the model (the segments hold its modules under their own names)"
        )


@dataclass(frozen=True)
class _Source:
    """The model a chain was captured from, held without registering it as a submodule."""

    model: nn.Module


@dataclass(frozen=True)
class _Example:
    """The capture's example inputs: their names (keywords, or ``input k``) and tensors, in order."""

    names: tuple[str, ...]
    tensors: tuple[torch.Tensor, ...]
    keywords: bool


def _example(example: Inputs) -> _Example:
    if isinstance(example, Mapping):
        names = tuple(str(k) for k in example)
        args: object = tuple(example.values())
        keywords = True
    else:
        args = (example,) if isinstance(example, torch.Tensor) else example
        names = tuple(f"input {k}" for k in range(len(args))) if isinstance(args, tuple) else ()
        keywords = False
    if not isinstance(args, tuple) or not args or not all(isinstance(a, torch.Tensor) for a in args):
        raise TypeError(
            f"the example input must be a tensor, a tuple of tensors (the model's positional inputs for one "
            f"micro-batch) or a mapping of keyword to tensor, got {type(example).__name__}"
        )
    sizes = {a.shape[0] if a.dim() else None for a in args}
    if None in sizes or len(sizes) != 1:
        raise ValueError(
            f"the example inputs must share their first (batch) dimension, got shapes {[tuple(a.shape) for a in args]}"
        )
    return _Example(names, tuple(standalone(a) for a in args), keywords)


def standalone(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as a tensor of its own: a view into a larger one (a slice of a batch, ``ids[:2, :-1]``) is
    copied into contiguous memory, so that torch.export sees no stride that ties its free sizes to the larger
    tensor's (a slice's row stride is the whole row's length, which a free sequence length contradicts)."""
    whole = tensor.is_contiguous() and tensor.storage_offset() == 0
    return tensor if whole or tensor.is_meta else tensor.clone(memory_format=torch.contiguous_format)


def _on_the_models_device(model: nn.Module, example: _Example) -> _Example:
    """The example on the meta device when the model is there: the ops that make tensors on the model's device
    (a causal mask on the weights' device) then say meta, which the segments map to where they run."""
    on_meta = any(t.is_meta for t in (*model.parameters(), *model.buffers()))
    if not on_meta or all(t.is_meta for t in example.tensors):
        return example
    return _Example(example.names, tuple(t.to("meta") for t in example.tensors), example.keywords)


def _length_limit(model: nn.Module) -> int | None:
    """The longest sequence the model takes, from a Hugging Face style config's ``max_position_embeddings``."""
    limit = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    return limit if isinstance(limit, int) and limit >= 2 else None


def _dynamic_shapes(example: _Example, length: int | None) -> dict[str, dict[int, Dim]] | tuple[dict[int, Dim], ...]:
    """Dim 0 of every input free (the batch); with ``length`` (the longest allowed), dim 1 of every integer input
    of at least two dimensions too (token ids, masks: the sequence length)."""
    from torch.export import Dim

    batch = Dim("batch", min=1)
    seq = Dim("length", min=2, max=length) if length is not None else None
    shapes = []
    for tensor in example.tensors:
        dims = {0: batch}
        if seq is not None and tensor.dim() >= 2 and not tensor.is_floating_point():
            dims[1] = seq
        shapes.append(dims)
    if example.keywords:
        return dict(zip(example.names, shapes, strict=True))
    return tuple(shapes)


@contextmanager
def _cache_off(model: nn.Module) -> Iterator[None]:
    """A model with a Hugging Face style config runs with ``use_cache`` off: a cache serves generation, not
    training, and it is no tensor the graph could return."""
    config = getattr(model, "config", None)
    if config is None or getattr(config, "use_cache", None) is not True:
        yield
        return
    config.use_cache = False
    try:
        yield
    finally:
        config.use_cache = True


def _export(model: nn.Module, example: _Example, blocks: Sequence[str], length: int | None) -> _Exported:
    """Export ``model`` with a marker before each block; also the blocks in the order they ran."""
    from torch.distributed.pipelining import pipe_split

    order: list[str] = []

    def marker(name: str):  # type: ignore[no-untyped-def]
        def hook(module: nn.Module, inputs: object) -> None:
            order.append(name)
            pipe_split()  # type: ignore[no-untyped-call]

        return hook

    handles = []
    for name in blocks:
        try:
            module = model.get_submodule(name)
        except AttributeError as err:
            raise ValueError(f"blocks names {name!r}, which is not a submodule of {type(model).__name__}") from err
        handles.append(module.register_forward_pre_hook(marker(name)))
    tensors = example.tensors
    if tensors[0].shape[0] == 1:  # export fixes a dimension of size 1: show it two samples, the batch stays symbolic
        tensors = tuple(torch.cat([a, a]) for a in tensors)
    args, kwargs = ((), dict(zip(example.names, tensors, strict=True))) if example.keywords else (tensors, None)
    try:
        with _cache_off(model), router_logits_off(model):
            ep = torch.export.export(model, args, kwargs, dynamic_shapes=_dynamic_shapes(example, length))
    except Exception as err:
        reason = next((line for line in str(err).splitlines() if line.strip()), "")
        raise CaptureError(
            f"torch.export could not capture {type(model).__name__}: {type(err).__name__}: {reason}\n"
            "Make its forward traceable (no data-dependent Python control flow, no graph breaks, the batch size "
            "not fixed in the code), or make it a chain that stagewise splits without capturing it: an nn.Sequential, "
            f"or a module whose '{CHAIN_ATTRIBUTE}' attribute lists its layers in execution order"
        ) from err
    finally:
        for handle in handles:
            handle.remove()
    return _Exported(ep, order)


@dataclass(frozen=True)
class _Exported:
    program: ExportedProgram
    order: list[str]
    """The blocks, in the order they ran."""


def capture(
    model: nn.Module,
    example: Inputs,
    *,
    blocks: Sequence[str] | None = None,
    output: str = "logits",
    dynamic_length: bool | None = None,
) -> CapturedChain:
    """Capture ``model`` with torch.export and cut it before each of its repeated blocks.

    The candidate split points are the beginnings of ``blocks`` (by default
    :func:`repeated_blocks`: the children of its ``nn.ModuleList`` or
    ``nn.Sequential`` of same-class modules) in the order they run; the part
    before the first block is a segment of its own, and the part after the
    last belongs to the last block's segment. Values that several segments
    use, such as an attention mask, position ids or a skip connection, are
    passed on from segment to segment. The batch dimension (dim 0 of every
    input) stays symbolic, so micro-batches of any size run.

    The model is taken as it is: a Hugging Face model needs no wrapper. Its
    inputs may be given by keyword (``{"input_ids": ..., "attention_mask":
    ...}``), and the chain then takes them so; a model that returns a mapping
    (a ``ModelOutput``, a dict, a dataclass) gives its entry ``output``. A
    model with a Hugging Face style config is captured with its cache off, and
    without its router logits (a mixture of experts' load-balancing loss, which
    needs every layer's; a warning says so when the config asks for them). A
    Hugging Face mixture of experts is captured with the experts implementation
    its config chooses (``"grouped_mm"`` by default); ``"eager"`` is refused.

    Args:
        model: the model, with real weights or on the meta device.
        example: one micro-batch of its inputs: a tensor, a tuple of tensors, or a mapping of keyword to tensor.
        blocks: paths of the modules to cut before; each must run exactly once per forward.
        output: the entry of a mapping output that the chain returns (what the loss reads).
        dynamic_length: whether dim 1 of the integer inputs (token ids, masks) stays free, so that any length up
            to the model's limit runs; None: when the model's config names that limit (``max_position_embeddings``).
            A fixed length runs only at the example's length; another is refused by name.

    Raises:
        CaptureError: torch.export cannot capture the model (a mixture of experts with ``"eager"`` experts too), or
            its graph cannot be cut (the message says why).
        ValueError: no blocks found or named, or a block runs more than once.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"capture expects an nn.Module, got {type(model).__name__}")
    inputs = _on_the_models_device(model, _example(example))
    _check_names(model)
    refuse_eager_experts(model)
    limit = _length_limit(model)
    free = dynamic_length if dynamic_length is not None else limit is not None
    exported = _export(model, inputs, _blocks_to_cut(model, blocks), limit if free else None)
    ep, order = exported.program, exported.order
    repeated = sorted({n for n in order if order.count(n) > 1})
    if repeated:
        raise ValueError(f"blocks {repeated} run more than once per forward; a split point must run exactly once")
    name = type(model).__name__
    chosen = chosen_output(ep.call_spec.out_spec, name, output)
    graphs, names = cut(ep, boundary_names=order, outputs=chosen.indices)
    segments = _segments(model, ep, graphs, names, on=inputs.tensors[0].device, bare_output=chosen.bare)
    note = f"its config's max_position_embeddings ({limit})" if free and limit is not None else ""
    call = call_spec(ep, name, keywords=inputs.keywords, names=inputs.names, length_note=note)
    chain = CapturedChain(model, segments, call)
    chain.train(model.training)  # in the mode it was captured in, as the model was
    _report(model, chain)
    return chain


def _blocks_to_cut(model: nn.Module, blocks: Sequence[str] | None) -> list[str]:
    """The blocks named, or else the model's repeated blocks; refused when there are none."""
    names = list(blocks) if blocks is not None else repeated_blocks(model)
    if not names:
        raise ValueError(
            f"{type(model).__name__} has no repeated blocks (an nn.ModuleList or nn.Sequential of at least two "
            "modules of one class) to cut before; name the modules to cut before with blocks=[...]"
        )
    return names


def _segments(
    model: nn.Module,
    ep: ExportedProgram,
    graphs: Sequence[SegmentGraph],
    names: Sequence[str],
    *,
    on: torch.device,
    bare_output: bool,
) -> list[Segment]:
    """The cut graphs as segments of ``model``, captured on device ``on``; the last returns a lone output bare
    when the model does (``bare_output``)."""
    # torch.export lists non-persistent buffers among its constants; they stay the model's buffers here, so that
    # materialising a meta model (or moving it) reaches them.
    buffers = {name for name, _ in model.named_buffers(remove_duplicate=False)}
    constants = {k: v for k, v in ep.constants.items() if isinstance(v, torch.Tensor) and k not in buffers}
    return [
        Segment(
            name,
            graph,
            model,
            constants,
            captured_on=on,
            captured_training=model.training,
            bare_output=bare_output if k == len(graphs) - 1 else True,
        )
        for k, (name, graph) in enumerate(zip(names, graphs, strict=True))
    ]


def _report(model: nn.Module, chain: CapturedChain) -> None:
    """Log what the capture made, and warn of parameters the forward never uses (no segment holds them)."""
    covered = {id(p) for s in chain.segments for p in s.parameters()}
    unused = [n for n, p in model.named_parameters() if id(p) not in covered]
    if unused:
        log.warning(
            "%d parameters of %s are never used in its forward: %s", len(unused), type(model).__name__, unused[:5]
        )
    log.info(
        "captured %s into %d segments (%s), %d shared parameters",
        type(model).__name__,
        len(chain.segments),
        ", ".join(s.segment_name for s in chain.segments),
        len(shared_parameters(chain.stagewise_layers())),
    )
