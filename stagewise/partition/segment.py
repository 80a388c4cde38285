"""Segment: one piece of a captured model, a pure graph of aten ops run on the modules whose tensors it reads."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from stagewise.partition.graph import SegmentGraph
from stagewise.partition.graph_variant import Cut, only_dropout_depends_on_the_mode, variant
from stagewise.partition.layers import Payload


@dataclass
class _Refs:
    """Where a segment finds its state, in the order its graph takes it, resolved at each call."""

    holders: list[tuple[nn.Module | None, str]]
    """(module, attribute) of each parameter or buffer; (None, name) for a tensor constant of the graph."""
    constants: dict[str, torch.Tensor]
    """The graph's tensor constants, by name; moved to the device of each call."""


class Segment(nn.Module):
    """One piece of a captured model: a pure graph of aten ops plus the modules whose tensors it reads.

    Its parameters are named as in the captured model (``blocks.3.attn.qkv.weight``):
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
        captured_on: torch.device,
        captured_training: bool,
        bare_output: bool,
    ) -> None:
        super().__init__()
        self.segment_name = name
        self.graph = graph
        self.captured_on = captured_on
        self.captured_training = captured_training
        self.bare_output = bare_output
        """Return a lone emitted value as a tensor rather than a 1-tuple."""
        self.record: Callable[[tuple[torch.Tensor, ...], object], None] | None = None
        """While set (and gradients are on), called with each op's output that reads state, and that state."""
        self.cut: Callable[[torch.Tensor], torch.Tensor] | None = None
        """While recording, the other inputs of each op that reads state pass through this (the identity whose
        backward zero-bubble's W stops at), so that W from one use of a parameter never reaches an earlier one."""
        self._variants: dict[tuple[torch.device, bool, bool], torch.fx.GraphModule] = {
            (captured_on, False, False): graph.module
        }
        tensors = [fqn for fqn in graph.state if fqn not in constants]
        persistent = set(model.state_dict(keep_vars=True))
        for path in _wholly_read(model, set(tensors)):
            self._attach(path, model.get_submodule(path))
        holders: list[tuple[nn.Module | None, str]] = []
        self._owners: dict[str, nn.Module] = {}
        """Path of a module here that holds some of the model's module at that path's tensors -> that module."""
        for fqn in graph.state:
            if fqn in constants:
                holders.append((None, fqn))
                continue
            parent, _, leaf = fqn.rpartition(".")
            here = self._find(parent)
            if here is None or not hasattr(here, leaf):  # read outside any wholly read module
                owner = model.get_submodule(parent) if parent else model
                here = self._container(parent)
                if here is not self:
                    self._owners[parent] = owner
                value = getattr(owner, leaf)
                if isinstance(value, nn.Parameter):
                    here.register_parameter(leaf, value)
                else:
                    here.register_buffer(leaf, value, persistent=fqn in persistent)
            holders.append((here, leaf))
        self._refs = _Refs(holders, {fqn: constants[fqn] for fqn in graph.state if fqn in constants})
        self._mutated = [self._holder_of(fqn) for fqn in graph.mutated]

    def owner_of(self, holder: nn.Module) -> nn.Module | None:
        """The model's module whose tensors ``holder`` (one of this segment's modules) holds some of, when
        ``holder`` stands in for it (the segment reads only part of it); None for a module of the model itself."""
        path = next((name for name, sub in self.named_modules() if sub is holder), None)
        return self._owners.get(path) if path is not None else None

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

    def _graph_on(self, device: torch.device, recording: bool, dropout_off: bool = False) -> torch.fx.GraphModule:
        key = (device, recording, dropout_off)
        module = self._variants.get(key)
        if module is None:
            extra = [use.node for use in self.graph.uses] if recording else []
            cut = Cut(self.cut, len(self.graph.state)) if recording and self.cut is not None else None
            module = variant(
                self.graph.module, old=self.captured_on, new=device, also_return=extra, dropout_off=dropout_off,
                cut=cut,
            )  # fmt: skip
            self._variants[key] = module
        return module

    def _state_device(self) -> torch.device:
        for module, leaf in self._refs.holders:
            if module is not None:
                device: torch.device = getattr(module, leaf).device
                return device
        return self.captured_on

    def forward(self, x: Payload) -> Payload:
        received = (x,) if isinstance(x, torch.Tensor) else tuple(x)
        if len(received) != self.graph.receives:
            raise ValueError(
                f"segment {self.segment_name!r} receives {self.graph.receives} tensors, got {len(received)}; "
                "call the captured model with the inputs it was captured with"
            )
        switched = self.graph.mode_dependent and self.training != self.captured_training
        dropout_off = switched and self.captured_training and only_dropout_depends_on_the_mode(self.graph.module)
        if switched and not dropout_off:
            mode = "training" if self.captured_training else "eval"
            raise RuntimeError(
                f"segment {self.segment_name!r} was captured in {mode} mode and contains dropout or batch norm, "
                f"whose behaviour the capture fixed; capture the model again in the mode you run it in"
            )
        device = received[0].device if received else self._state_device()
        state = [
            getattr(module, leaf) if module is not None else self._refs.constants[leaf].to(device)
            for module, leaf in self._refs.holders
        ]
        recording = self.record is not None and torch.is_grad_enabled()
        out = self._graph_on(device, recording, dropout_off)(*state, *received)
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
    identity: dict[str, int] = {}
    for name, tensor in _named_tensors(model, remove_duplicate=False):
        aliases.setdefault(id(tensor), set()).add(name)
        identity[name] = id(tensor)
    read = {alias for name in read if name in identity for alias in aliases[identity[name]]}  # a tie by any name
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
