"""Activation checkpointing's recomputation: whole or selective, and repeatable by every backward that needs it.

A split backward (zero-bubble, ZBV, DualPipeV) runs two backwards through each micro-batch's graph: I for the
input gradient, W later for the weight gradients. ``torch.utils.checkpoint`` recomputes a checkpointed layer in
each backward that reaches it, so W recomputes what it needs again; torch's own selective checkpointing refuses
the second backward ("only allowed to backward once"), since its recomputation consumes what the forward kept.
:func:`recompute_contexts` keeps the same outputs (those a :class:`~stagewise.pipeline.SelectiveCheckpointing`
chooses) and lends them to every recomputation, so each of them runs only the ops that were not kept; what was
kept lives as long as the graph that saved it.

Keeping the recomputed activations from I until W instead would hold, between the two, the very activations
checkpointing drops: under the default policy, W's recomputation is the cheap elementwise ops that feed the
weights' matmuls.

Private names of torch relied on (as its own selective checkpointing relies on them): ``SAC_IGNORED_OPS``'s
meaning, and ``torch._C._SetExcludeDispatchKeyGuard`` to detach below autograd with the version counter shared.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map_only
from torch.utils.checkpoint import SAC_IGNORED_OPS

from stagewise.errors import StagewiseError
from stagewise.pipeline.config import SelectiveCheckpointing


class KeptOutputChangedError(StagewiseError, RuntimeError):
    """An op's output that selective checkpointing kept was changed in place before the backward read it."""


@contextmanager
def statistics_frozen(layer: nn.Module) -> Iterator[None]:
    """Batch norms of ``layer`` run as in training, and their running statistics come out as they went in.

    For a checkpoint's recomputation: the forward already updated them once. The buffers are put back through
    ``.data``, whose version counter is its own: the recomputed graph saved them, and autograd would refuse them
    changed in place (a batch norm's training backward does not read them).
    """
    tracking = [m for m in layer.modules() if isinstance(m, _BatchNorm) and m.training and m.track_running_stats]
    kept = [(b, b.clone()) for m in tracking for b in m.buffers(recurse=False)]
    try:
        yield
    finally:
        for buffer, value in kept:
            buffer.data.copy_(value)


@dataclass
class _Kept:
    """The outputs a selective forward kept, by op and by how many times the forward had called it before."""

    outputs: dict[tuple[Any, int], tuple[Any, dict[int, int]]] = field(default_factory=dict)
    """(op, call) -> (its outputs detached, each output tensor's version when kept, by ``id``)."""


def _detached(t: torch.Tensor) -> torch.Tensor:
    """``t`` detached, sharing its version counter: below autograd (in a dispatch mode) ``detach`` shares it only
    with the ADInplaceOrView key let back in, as torch's own selective checkpointing does."""
    with torch._C._SetExcludeDispatchKeyGuard(torch._C.DispatchKey.ADInplaceOrView, False):
        return t.detach()


def _counted(counts: Counter[Any], func: Any) -> int:
    n = counts[func]
    counts[func] += 1
    return n


def _versions(out: Any) -> dict[int, int]:
    found: dict[int, int] = {}
    tree_map_only(torch.Tensor, lambda t: found.setdefault(id(t), t._version), out)
    return found


class _Keeping(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """The forward: each op runs, and the outputs of those ``selective`` saves are kept in ``kept``."""

    def __init__(self, selective: SelectiveCheckpointing, kept: _Kept) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.selective = selective
        self.kept = kept
        self.counts: Counter[Any] = Counter()

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        if func in SAC_IGNORED_OPS or not self.selective.saves(func):
            return out
        detached = tree_map_only(torch.Tensor, _detached, out)
        self.kept.outputs[(func, _counted(self.counts, func))] = (detached, _versions(detached))
        return out


class _Reusing(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """A recomputation: the ops the forward kept return what it kept; every other op runs again."""

    def __init__(self, kept: _Kept) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.kept = kept
        self.counts: Counter[Any] = Counter()

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        if func not in SAC_IGNORED_OPS:
            hit = self.kept.outputs.get((func, _counted(self.counts, func)))
            if hit is not None:
                outputs, versions = hit
                if _versions(outputs) != versions:
                    raise KeptOutputChangedError(
                        f"selective checkpointing kept the output of {func}, which the layer then changed in place; "
                        "leave that op out of SelectiveCheckpointing.keep, or write the layer out of place"
                    )
                return tree_map_only(torch.Tensor, _detached, outputs)
        return func(*args, **(kwargs or {}))


class _EachTime(AbstractContextManager[None]):
    """A context that builds its contexts afresh each time it is entered: a checkpoint's recomputation context
    is entered once per backward that recomputes (I, then W)."""

    def __init__(self, *makers: Callable[[], AbstractContextManager[Any]]) -> None:
        self.makers = makers
        self._stacks: list[ExitStack] = []

    def __enter__(self) -> None:
        stack = ExitStack()
        for make in self.makers:
            stack.enter_context(make())
        self._stacks.append(stack)

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> bool | None:
        return self._stacks.pop().__exit__(kind, error, trace)


def recompute_contexts(
    layer: nn.Module,
    selective: SelectiveCheckpointing | None,
    *also: Callable[[], AbstractContextManager[Any]],
) -> tuple[AbstractContextManager[Any], AbstractContextManager[Any]]:
    """``checkpoint``'s ``context_fn`` for ``layer``: the forward's context, and the recomputation's, which any
    number of backwards may enter (one after another), each with ``layer``'s batch-norm statistics frozen and within
    a fresh context of each of ``also``. With ``selective``, the forward keeps the outputs of the ops it saves and
    every recomputation reuses them."""
    frozen: list[Callable[[], AbstractContextManager[Any]]] = [lambda: statistics_frozen(layer), *also]
    if selective is None:
        return nullcontext(), _EachTime(*frozen)
    kept = _Kept()
    return _Keeping(selective, kept), _EachTime(lambda: _Reusing(kept), *frozen)
