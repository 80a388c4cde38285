"""Where a stage's weight gradients start: the output of every op that reads a parameter, for zero-bubble's W."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from stagewise.pipeline.fusion import fused_params


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
    no gradient are not recorded.
    """

    def __init__(self, params: Iterable[torch.Tensor], uses: list[WeightUse]) -> None:
        super().__init__()
        self.ids = frozenset(id(p) for p in params)
        self.uses = uses
        """Where the records go; may be replaced between forwards, to record each into a list of its own."""

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Iterable[type],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if torch.is_grad_enabled():
            read = _read(args, kwargs, self.ids)
            use = WeightUse.of(read, out) if read else None
            if use is not None:
                self.uses.append(use)
        return out


def _read(args: tuple[Any, ...], kwargs: dict[str, Any], ids: frozenset[int]) -> tuple[torch.Tensor, ...]:
    """The parameters among ``args`` and ``kwargs`` (nested in lists and tuples too) that require grad, once each."""
    found: dict[int, torch.Tensor] = {}
    for value in (*args, *kwargs.values()):
        for leaf in tree_leaves(value) if isinstance(value, (list, tuple, dict)) else (value,):
            if isinstance(leaf, torch.Tensor) and id(leaf) in ids and leaf.requires_grad:
                found.setdefault(id(leaf), leaf)
    return tuple(found.values())
