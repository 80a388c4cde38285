"""trace(): a model that is not a chain, captured by torch.export and cut at its repeated blocks into a chain."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:  # torch.export imports dynamo: seconds, paid only when tracing
    from torch.export import ExportedProgram

from stagewise.partition.graph import SegmentGraph, TraceError, cut, variant
from stagewise.partition.layers import CHAIN_ATTRIBUTE, Layer, shared_parameters
from stagewise.partition.profile import Payload

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


@dataclass
class _Refs:
    """Where a segment finds its state, in the order its graph takes it, resolved at each call."""

    holders: list[tuple[nn.Module | None, str]]
    """(module, attribute) of each parameter or buffer; (None, name) for a tensor constant of the graph."""
    constants: dict[str, torch.Tensor]
    """The graph's tensor constants, by name; moved to the device of each call."""


class Segment(nn.Module):
    """One piece of a traced model: a pure graph of aten ops plus the modules whose tensors it reads.

    Its parameters are named as in the traced model (``blocks.3.attn.qkv.weight``):
    the modules it reads wholly are registered at their paths, the same
    objects as in the model, so materialising the segment materialises them.
    It takes the values the previous segment emits (the model's inputs, for
    the first) and returns those the next one needs (the model's output, for
    the last).
    """

    def __init__(
        self,
        name: str,
        graph: SegmentGraph,
        model: nn.Module,
        constants: dict[str, torch.Tensor],
        *,
        traced_on: torch.device,
        traced_training: bool,
        bare_output: bool,
    ) -> None:
        super().__init__()
        self.segment_name = name
        self.graph = graph
        self.traced_on = traced_on
        self.traced_training = traced_training
        self.bare_output = bare_output
        """Return a lone emitted value as a tensor rather than a 1-tuple."""
        self.record: Callable[[tuple[torch.Tensor, ...], object], None] | None = None
        """While set (and gradients are on), called with each op's output that reads state, and that state."""
        self._variants: dict[tuple[torch.device, bool], torch.fx.GraphModule] = {(traced_on, False): graph.module}
        tensors = [fqn for fqn in graph.state if fqn not in constants]
        persistent = set(model.state_dict(keep_vars=True))
        for path in _wholly_read(model, set(tensors)):
            self._attach(path, model.get_submodule(path))
        holders: list[tuple[nn.Module | None, str]] = []
        for fqn in graph.state:
            if fqn in constants:
                holders.append((None, fqn))
                continue
            parent, _, leaf = fqn.rpartition(".")
            here = self._find(parent)
            if here is None or not hasattr(here, leaf):  # read outside any wholly read module
                owner = model.get_submodule(parent) if parent else model
                here = self._container(parent)
                value = getattr(owner, leaf)
                if isinstance(value, nn.Parameter):
                    here.register_parameter(leaf, value)
                else:
                    here.register_buffer(leaf, value, persistent=fqn in persistent)
            holders.append((here, leaf))
        self._refs = _Refs(holders, {fqn: constants[fqn] for fqn in graph.state if fqn in constants})
        self._mutated = [self._holder_of(fqn) for fqn in graph.mutated]

    def _find(self, path: str) -> nn.Module | None:
        try:
            return self.get_submodule(path) if path else self
        except AttributeError:
            return None

    def _container(self, path: str) -> nn.Module:
        here: nn.Module = self
        for atom in path.split(".") if path else []:
            nxt = here._modules.get(atom)
            if nxt is None:
                nxt = nn.Module()
                here.add_module(atom, nxt)
            here = nxt
        return here

    def _attach(self, path: str, module: nn.Module) -> None:
        parent, _, leaf = path.rpartition(".")
        self._container(parent).add_module(leaf, module)

    def _holder_of(self, fqn: str) -> tuple[nn.Module, str]:
        parent, _, leaf = fqn.rpartition(".")
        here = self._find(parent)
        assert here is not None
        return here, leaf

    def _graph_on(self, device: torch.device, recording: bool) -> torch.fx.GraphModule:
        key = (device, recording)
        module = self._variants.get(key)
        if module is None:
            extra = [use.node for use in self.graph.uses] if recording else []
            module = variant(self.graph.module, old=self.traced_on, new=device, also_return=extra)
            self._variants[key] = module
        return module

    def _state_device(self) -> torch.device:
        for module, leaf in self._refs.holders:
            if module is not None:
                device: torch.device = getattr(module, leaf).device
                return device
        return self.traced_on

    def forward(self, x: Payload) -> Payload:
        received = (x,) if isinstance(x, torch.Tensor) else tuple(x)
        if len(received) != self.graph.receives:
            raise ValueError(
                f"segment {self.segment_name!r} receives {self.graph.receives} tensors, got {len(received)}; "
                "call the traced model with the inputs it was traced with"
            )
        if self.graph.mode_dependent and self.training != self.traced_training:
            mode = "training" if self.traced_training else "eval"
            raise RuntimeError(
                f"segment {self.segment_name!r} was traced in {mode} mode and contains dropout or batch norm, "
                f"whose behaviour tracing fixed; trace the model again in the mode you run it in"
            )
        device = received[0].device if received else self._state_device()
        state = [
            getattr(module, leaf) if module is not None else self._refs.constants[leaf].to(device)
            for module, leaf in self._refs.holders
        ]
        recording = self.record is not None and torch.is_grad_enabled()
        out = self._graph_on(device, recording)(*state, *received)
        own = self.graph.emits + len(self._mutated)
        if self._mutated:
            with torch.no_grad():
                for (module, leaf), new in zip(self._mutated, out[self.graph.emits : own], strict=True):
                    getattr(module, leaf).copy_(new)
        if recording:
            assert self.record is not None
            for use, value in zip(self.graph.uses, out[own:], strict=True):
                self.record(tuple(state[i] for i in use.state), value)
        values = tuple(out[: self.graph.emits])
        return values[0] if len(values) == 1 and self.bare_output else values


def _wholly_read(model: nn.Module, read: set[str]) -> list[str]:
    """The outermost modules (not the model itself) all of whose parameters and buffers are in ``read``."""
    aliases: dict[int, set[str]] = {}
    for name, tensor in _named_tensors(model, remove_duplicate=False):
        aliases.setdefault(id(tensor), set()).add(name)
    read = {alias for name, tensor in _named_tensors(model) if name in read for alias in aliases[id(tensor)]}
    chosen: list[str] = []

    def visit(prefix: str, module: nn.Module) -> None:
        for name, child in module.named_children():
            path = f"{prefix}.{name}" if prefix else name
            names = {f"{path}.{n}" for n, _ in _named_tensors(child, remove_duplicate=False)}
            if names and names <= read:
                chosen.append(path)
            elif names & read:
                visit(path, child)

    visit("", model)
    return chosen


def _named_tensors(module: nn.Module, remove_duplicate: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    yield from module.named_parameters(remove_duplicate=remove_duplicate)
    yield from module.named_buffers(remove_duplicate=remove_duplicate)


class TracedChain(nn.Module):
    """A model that is not a chain, as a chain of :class:`Segment`\\ s cut at its repeated blocks.

    It holds the traced model's modules under their own names, so its
    ``state_dict`` is the model's; running it runs the segments one after
    another and equals running the model. :func:`stagewise.partition.layers_of`
    returns its segments, so ``profile``, ``balance``, ``auto``,
    :class:`stagewise.Pipeline` and ``Partition.split_spec`` take it like any
    chain, and parameters keep the model's names.
    """

    def __init__(self, model: nn.Module, segments: Sequence[Segment]) -> None:
        super().__init__()
        for name, child in model.named_children():
            self.add_module(name, child)
        keys = set(model.state_dict(keep_vars=True))
        for name, param in model.named_parameters(recurse=False):
            self.register_parameter(name, param)
        for name, buffer in model.named_buffers(recurse=False):
            self.register_buffer(name, buffer, persistent=name in keys)
        self.source = _Source(model)
        """The traced model (for ``torch.distributed.pipelining.pipeline()``, which traces it again)."""
        self.segments = list(segments)

    def stagewise_layers(self) -> list[Layer]:
        """The segments, as the layers of a chain; each names its parameters in full."""
        return [Layer(s.segment_name, s, prefix="") for s in self.segments]

    def train(self, mode: bool = True) -> TracedChain:
        super().train(mode)
        for segment in self.segments:
            segment.train(mode)
        return self

    def forward(self, *inputs: torch.Tensor) -> Payload:
        x: Payload = inputs[0] if len(inputs) == 1 else tuple(inputs)
        for segment in self.segments:
            x = segment(x)
        return x


_OWN_NAMES = frozenset(
    {"segment_name", "graph", "traced_on", "traced_training", "bare_output", "record", "source", "segments"}
    | {name for cls in (Segment, TracedChain) for name in vars(cls) if not name.startswith("__")}
)
"""Attributes of segments and traced chains, which hold the model's own modules under their names."""


def _check_names(model: nn.Module) -> None:
    """Refuse a model whose top-level modules or tensors take a name the traced chain's pieces use themselves."""
    top = [name for name, _ in (*model.named_children(), *model.named_parameters(recurse=False))]
    top += [name for name, _ in model.named_buffers(recurse=False)]
    taken = sorted(set(top) & _OWN_NAMES)
    if taken:
        raise TraceError(
            f"{type(model).__name__} has attributes named {taken}, which trace() keeps for the segments and the "
            f"chain it builds; rename them in the model (the segments hold its modules under their own names)"
        )


@dataclass(frozen=True)
class _Source:
    """The model a chain was traced from, held without registering it as a submodule."""

    model: nn.Module


def _example(example: Payload) -> tuple[torch.Tensor, ...]:
    args = (example,) if isinstance(example, torch.Tensor) else example
    if not isinstance(args, tuple) or not args or not all(isinstance(a, torch.Tensor) for a in args):
        raise TypeError(
            f"the example input must be a tensor or a tuple of tensors (the model's positional inputs for one "
            f"micro-batch), got {type(example).__name__}"
        )
    sizes = {a.shape[0] if a.dim() else None for a in args}
    if None in sizes or len(sizes) != 1:
        raise ValueError(
            f"the example inputs must share their first (batch) dimension, got shapes {[tuple(a.shape) for a in args]}"
        )
    return args


def _export(
    model: nn.Module, args: tuple[torch.Tensor, ...], blocks: Sequence[str]
) -> tuple[ExportedProgram, list[str]]:
    """Export ``model`` with a marker before each block; also the blocks in the order they ran."""
    from torch.distributed.pipelining import pipe_split
    from torch.export import Dim

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
    batch = Dim("batch", min=1)
    if args[0].shape[0] == 1:  # export fixes a dimension of size 1: show it two samples, the batch stays symbolic
        args = tuple(torch.cat([a, a]) for a in args)
    try:
        ep = torch.export.export(model, args, dynamic_shapes=tuple({0: batch} for _ in args))
    except Exception as err:
        reason = next((line for line in str(err).splitlines() if line.strip()), "")
        raise TraceError(
            f"torch.export could not capture {type(model).__name__}: {type(err).__name__}: {reason}\n"
            "Make its forward traceable (no data-dependent Python control flow, no graph breaks, the batch size "
            "not fixed in the code), or make it a chain that stagewise splits without tracing: an nn.Sequential, "
            f"or a module whose '{CHAIN_ATTRIBUTE}' attribute lists its layers in execution order"
        ) from err
    finally:
        for handle in handles:
            handle.remove()
    return ep, order


def trace(model: nn.Module, example: Payload, *, blocks: Sequence[str] | None = None) -> TracedChain:
    """Capture ``model`` with torch.export and cut it before each of its repeated blocks.

    The candidate split points are the beginnings of ``blocks`` (by default
    :func:`repeated_blocks`: the children of its ``nn.ModuleList`` or
    ``nn.Sequential`` of same-class modules) in the order they run; the part
    before the first block is a segment of its own, and the part after the
    last belongs to the last block's segment. Values that several segments
    use, such as an attention mask, position ids or a skip connection, are
    passed on from segment to segment. The batch dimension (dim 0 of every
    input) stays symbolic, so micro-batches of any size run.

    Args:
        model: the model, with real weights or on the meta device.
        example: one micro-batch of its positional inputs: a tensor or a tuple of tensors.
        blocks: paths of the modules to cut before; each must run exactly once per forward.

    Raises:
        TraceError: torch.export cannot capture the model, or its graph cannot be cut (the message says why).
        ValueError: no blocks found or named, or a block runs more than once.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"trace expects an nn.Module, got {type(model).__name__}")
    args = _example(example)
    _check_names(model)
    names = list(blocks) if blocks is not None else repeated_blocks(model)
    if not names:
        raise ValueError(
            f"{type(model).__name__} has no repeated blocks (an nn.ModuleList or nn.Sequential of at least two "
            "modules of one class) to cut before; name the modules to cut before with blocks=[...]"
        )
    ep, order = _export(model, args, names)
    repeated = sorted({n for n in order if order.count(n) > 1})
    if repeated:
        raise ValueError(f"blocks {repeated} run more than once per forward; a split point must run exactly once")
    spec = ep.call_spec.out_spec
    bare = spec is None or spec.is_leaf()
    if not bare and not (spec.type in (tuple, list) and all(c.is_leaf() for c in spec.children_specs)):
        raise TraceError(f"{type(model).__name__} must return a tensor or a tuple of tensors, its output is {spec}")
    graphs, names = cut(ep, boundary_names=order)
    device = args[0].device
    # torch.export lists non-persistent buffers among its constants; they stay the model's buffers here, so that
    # materialising a meta model (or moving it) reaches them.
    buffers = {name for name, _ in model.named_buffers(remove_duplicate=False)}
    constants = {k: v for k, v in ep.constants.items() if isinstance(v, torch.Tensor) and k not in buffers}
    segments = [
        Segment(
            name,
            graph,
            model,
            constants,
            traced_on=device,
            traced_training=model.training,
            bare_output=bare if k == len(graphs) - 1 else True,
        )
        for k, (name, graph) in enumerate(zip(names, graphs, strict=True))
    ]
    chain = TracedChain(model, segments)
    chain.train(model.training)  # in the mode it was traced in, as the model was
    covered = {id(p) for s in segments for p in s.parameters()}
    unused = [n for n, p in model.named_parameters() if id(p) not in covered]
    if unused:
        log.warning(
            "%d parameters of %s are never used in its forward: %s", len(unused), type(model).__name__, unused[:5]
        )
    log.info(
        "traced %s into %d segments (%s), %d shared parameters",
        type(model).__name__,
        len(segments),
        ", ".join(names),
        len(shared_parameters(chain.stagewise_layers())),
    )
    return chain
