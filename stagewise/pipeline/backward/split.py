"""Where weight gradients start (the output of each op that reads a parameter), and zero-bubble's W from there."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch.autograd.function import BackwardCFunction
from torch.autograd.graph import get_gradient_edge
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves, tree_map_only

from stagewise.pipeline.backward.fusion import fused_params
from stagewise.pipeline.backward.gradients import grad_tensors


@dataclass(frozen=True)
class WeightUse:
    """An output computed directly from parameters: where a deferred weight gradient (W) starts.

    The output of one op that reads the parameters (a linear layer's
    ``F.linear``, a layer norm, a matmul with another module's weight, a view
    of a parameter). W runs autograd from its gradient to ``params`` only, so
    no activation gradient is computed again and every read of a parameter
    contributes once.
    """

    params: tuple[torch.Tensor, ...]
    output: torch.Tensor | tuple[torch.Tensor, ...]

    @classmethod
    def of(cls, params: tuple[torch.Tensor, ...], output: object) -> WeightUse | None:
        """The use of ``params`` that computed ``output``; None when no tensor in it carries a gradient."""
        tensors = [t for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad]
        if not tensors:
            return None
        return cls(params, tensors[0] if len(tensors) == 1 else tuple(tensors))

    @property
    def fused(self) -> bool:
        """Whether a fused op accumulates every trainable parameter of this use itself (W needs no autograd)."""
        ids = {id(p) for p in fused_params(self.output)}
        return bool(ids) and all(id(p) in ids for p in self.params if p.requires_grad)


class ParameterUses(TorchFunctionMode):
    """Within this mode, each op that reads one of ``params`` appends a :class:`WeightUse` to ``uses``.

    Only ops called directly under the mode are seen, not the ops they call
    in turn, so each read of a parameter is recorded once, however the model
    reaches it: in its module's own forward, through a functional call on
    another module's weight (tied weights), or through a view. Reads without
    grad mode, of parameters that do not require grad, or whose outputs carry
    no gradient are not recorded, nor an op that hands the parameter back
    itself (``w.to(w.dtype)``): the ops that then read it are.
    """

    def __init__(self, params: Iterable[torch.Tensor], uses: list[WeightUse]) -> None:
        super().__init__()
        self.ids = frozenset(id(p) for p in params)
        self._uses = uses
        self._seen: set[int] = set()
        self.hidden: dict[int, torch.Tensor] = {}
        """Parameters read with grad mode off (inside a custom ``autograd.Function``, say), which no use records."""
        self.cut_all = False
        """Mark the other inputs of every op that reads a parameter, so that one backward from all the uses'
        outputs gives each parameter its gradient in one accumulation (W under DDP, whose hooks fire once)."""

    @property
    def uses(self) -> list[WeightUse]:
        """Where the records go; may be replaced between forwards, to record each into a list of its own."""
        return self._uses

    @uses.setter
    def uses(self, uses: list[WeightUse]) -> None:
        self._uses = uses
        self._seen = {id(p) for use in uses for p in use.params}

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Iterable[type],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if not torch.is_grad_enabled():
            for p in _read(args, kwargs, self.ids):
                self.hidden[id(p)] = p
            return func(*args, **kwargs)
        read = _read(args, kwargs, self.ids)
        if read and (self.cut_all or any(id(p) in self._seen for p in read)):
            # A parameter read before in this forward (a module called twice): W from this op must not reach it
            # again through this op's other inputs, so mark them where W stops (see direct_gradients_only).
            _refuse_in_place(func, args, self.ids)
            args, kwargs = tree_map_only(torch.Tensor, self._cut, (args, kwargs))
        out = func(*args, **kwargs)
        if any(out is p for p in read):  # the parameter handed back (``w.to(w.dtype)``): no read, the next op's is
            return out
        use = WeightUse.of(read, out) if read else None
        if use is not None:
            self._uses.append(use)
            self._seen.update(id(p) for p in read)
        return out

    def _cut(self, t: torch.Tensor) -> torch.Tensor:
        if t.requires_grad and id(t) not in self.ids:
            out: torch.Tensor = _Stop.apply(t)  # type: ignore[no-untyped-call]
            return out
        return t


def _refuse_in_place(func: Callable[..., Any], args: tuple[Any, ...], ids: frozenset[int]) -> None:
    """Refuse an in-place op on an activation where W must stop: the mark W stops at cannot be changed in place."""
    name = getattr(func, "__name__", "")
    in_place = (name.endswith("_") and not name.endswith("__")) or (name.startswith("__i") and name.endswith("__"))
    target = args[0] if args else None
    if in_place and isinstance(target, torch.Tensor) and target.requires_grad and id(target) not in ids:
        raise RuntimeError(
            f"an in-place {name} reads a parameter that W (zero-bubble's weight pass) must reach through this op "
            "alone (a parameter read twice in one forward, or any under data parallelism), and that cannot be "
            "marked on a tensor changed in place; write it out of place (x = x + self.pos, not x += self.pos)"
        )


_DIRECT_ONLY = [False]
"""Whether autograd stops at the marks of :class:`_Stop` (during W); a list, so that every thread sees it."""


class _Stop(torch.autograd.Function):
    """The identity, whose backward passes the gradient on, except within :func:`direct_gradients_only`."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor | None:
        return None if _DIRECT_ONLY[0] else grad


def stop_for_weight_gradients(x: torch.Tensor) -> torch.Tensor:
    """``x`` through the identity that zero-bubble's W stops at (see :func:`direct_gradients_only`); I passes."""
    if not x.requires_grad:
        return x
    out: torch.Tensor = _Stop.apply(x)  # type: ignore[no-untyped-call]
    return out


@contextmanager
def direct_gradients_only() -> Iterator[None]:
    """Within, autograd from a use's output stops at the inputs :class:`ParameterUses` marked: zero-bubble's W.

    Those are the non-parameter inputs of an op that reads a parameter read
    before it in the same forward, so each read contributes once.
    """
    _DIRECT_ONLY[0] = True
    try:
        yield
    finally:
        _DIRECT_ONLY[0] = False


def _read(args: tuple[Any, ...], kwargs: dict[str, Any], ids: frozenset[int]) -> tuple[torch.Tensor, ...]:
    """The parameters among ``args`` and ``kwargs`` (nested in lists and tuples too) that require grad, once each."""
    found: dict[int, torch.Tensor] = {}
    for value in (*args, *kwargs.values()):
        for leaf in tree_leaves(value) if isinstance(value, (list, tuple, dict)) else (value,):
            if isinstance(leaf, torch.Tensor) and id(leaf) in ids and leaf.requires_grad:
                found.setdefault(id(leaf), leaf)
    return tuple(found.values())


def weight_gradients(
    owners: Sequence[WeightUse],
    grads: Sequence[Sequence[torch.Tensor | None]],
    *,
    joint: bool = False,
    before: Callable[[list[torch.Tensor]], list[torch.Tensor]] | None = None,
) -> None:
    """Zero-bubble's W: each use's parameter gradients, from the gradients of its outputs that I computed.

    Autograd runs from each use's outputs to its parameters only, and stops
    at the inputs :class:`ParameterUses` marked, so no activation gradient is
    computed again and each read of a parameter contributes once. With
    ``joint`` (every op's inputs marked), one backward covers all the uses,
    so each parameter is accumulated once. ``before`` runs before the
    backwards, with their roots, and returns roots of a backward to run as
    well (DDP arms its reducer there; see :meth:`Replicas.prepare`).
    """
    jobs = []
    for use, got in zip(owners, grads, strict=True):
        params = [p for p in use.params if p.requires_grad]
        pairs = [(t, g) for t, g in zip(grad_tensors(use.output), got, strict=True) if g is not None]
        if params and pairs:
            jobs.append((params, pairs))
    if joint and jobs:
        unique = {id(p): p for params, _ in jobs for p in params}
        jobs = [(list(unique.values()), [pair for _, pairs in jobs for pair in pairs])]
    extra = before([t for _, pairs in jobs for t, _ in pairs]) if before is not None else []
    with direct_gradients_only():
        for params, pairs in jobs:
            torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs], inputs=params, retain_graph=True)
    if extra:
        torch.autograd.backward(extra)


def unseen_reads(output: object, hidden: dict[int, torch.Tensor]) -> list[tuple[torch.Tensor, str]]:
    """Parameters of ``hidden`` that a custom ``autograd.Function`` in ``output``'s graph reads directly, each with
    that Function's name: their gradient flows through no op :class:`ParameterUses` saw, so W would miss it."""
    targets = {get_gradient_edge(p).node: p for p in hidden.values()}
    found: dict[int, tuple[torch.Tensor, str]] = {}
    stack = [t.grad_fn for t in grad_tensors(output) if t.grad_fn is not None]
    seen = set(stack)
    while stack:
        node = stack.pop()
        for child, _ in node.next_functions:
            if child is None:
                continue
            if child in targets and isinstance(node, BackwardCFunction):
                param = targets[child]
                found.setdefault(id(param), (param, node.name()))
            if child not in seen:
                seen.add(child)
                stack.append(child)
    return list(found.values())
