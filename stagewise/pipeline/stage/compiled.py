"""Compiled stages: each layer compiled by ``torch.compile`` (its backward through AOTAutograd), its graphs counted."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn

log = logging.getLogger(__name__)


class CompiledGraphs:
    """The ``torch.compile`` backend of every compiled layer on a rank: ``backend`` itself, counting the graphs.

    Dynamo calls a backend once per graph it compiles: a layer's first call, a
    recompilation (a guard failed: another shape, dtype or grad mode), a graph
    break's second half. Layers of one class share their graphs (their
    parameters are the graphs' inputs), so a chain of equal blocks compiles
    one graph for them all, and equal shapes compile nothing after the first
    step: :attr:`count` is how to see that.
    """

    def __init__(self, backend: str) -> None:
        self.backend = backend
        """The backend's name in ``torch.compile``'s registry (``"inductor"``, ``"aot_eager"``, ...)."""
        self.count = 0
        """The graphs compiled so far on this rank, recompilations included."""
        # torch.compile takes a backend by name or as a callable; the registry's lookup (private, stable since
        # torch 2.0) gives the callable this one wraps.
        self._compile: Callable[..., Any] = torch._dynamo.lookup_backend(backend)

    def __call__(self, graph: torch.fx.GraphModule, example_inputs: Sequence[object]) -> Callable[..., Any]:
        self.count += 1
        log.info("compiling graph %d (%d nodes) with %s", self.count, len(graph.graph.nodes), self.backend)
        return self._compile(graph, example_inputs)  # type: ignore[no-any-return]


def compile_layers(layers: Iterable[nn.Module], graphs: CompiledGraphs) -> None:
    """Compile each of ``layers`` in place (``nn.Module.compile``: names, parameters and state dicts unchanged)."""
    for layer in layers:
        layer.compile(backend=graphs)


def backend_of(value: bool | str) -> str | None:
    """The backend a ``compile`` setting names: None for False, ``"inductor"`` for True, else the name itself."""
    if value is True:
        return "inductor"
    return value or None
