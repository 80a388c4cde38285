"""Fused weight-gradient accumulation: a linear layer's backward adds its weight gradient straight into ``.grad``."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch.autograd.function import FunctionCtx, once_differentiable
from torch.overrides import TorchFunctionMode

from stagewise.partition.linears import LINEAR_OPS


def _accumulate(param: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``param.grad += a @ b`` as one GEMM that reads and writes ``.grad`` in place (or sets it)."""
    if param.grad is None:
        param.grad = a.mm(b)
    elif param.grad.layout != torch.strided:  # a sparse gradient left by a tied sparse embedding
        param.grad = a.mm(b) + param.grad  # dense + sparse: torch adds them only this way round
    else:
        param.grad.addmm_(a, b)


def _accumulate_bias(bias: torch.Tensor | None, rows: torch.Tensor) -> None:
    """``bias.grad += rows.sum(0)``, for a bias that trains."""
    if bias is None or not bias.requires_grad:
        return
    total = rows.sum(0)
    if bias.grad is None:
        bias.grad = total
    else:
        bias.grad.add_(total)


@dataclass
class _Deferred:
    """One weight's pending gradient: the output gradients and inputs of each backward, as rows."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    grads: list[torch.Tensor] = field(default_factory=list)
    inputs: list[torch.Tensor] = field(default_factory=list)


class WeightGradientStore:
    """Weight gradients deferred to :meth:`flush`, which computes each weight's as one GEMM over every backward.

    A fused backward with a store computes only its input gradient and
    leaves its output gradient and input here. ``flush`` then adds
    ``cat(grads).T @ cat(inputs)`` to each weight's ``.grad``: one pass over
    the gradient for all micro-batches instead of one per micro-batch. The
    store keeps those tensors alive until then.
    """

    def __init__(self) -> None:
        self._pending: dict[tuple[int, int], _Deferred] = {}
        """Keyed by (weight, bias): a weight read with and without a bias keeps the two apart."""

    def add(self, weight: torch.Tensor, bias: torch.Tensor | None, grads: torch.Tensor, inputs: torch.Tensor) -> None:
        entry = self._pending.setdefault((id(weight), id(bias)), _Deferred(weight, bias))
        entry.grads.append(grads.detach())
        entry.inputs.append(inputs.detach())

    def __len__(self) -> int:
        """The number of (weight, bias) pairs with a pending gradient."""
        return len(self._pending)

    def tensors(self) -> Iterator[torch.Tensor]:
        """Every tensor the store keeps alive: each pending backward's output gradient and input."""
        for entry in self._pending.values():
            yield from entry.grads
            yield from entry.inputs

    def flush(self) -> None:
        """Add every pending gradient to its ``.grad``, and forget them."""
        pending, self._pending = self._pending, {}
        with torch.no_grad():  # gradients are not part of any graph
            self._apply(pending.values())

    @staticmethod
    def _apply(pending: Iterable[_Deferred]) -> None:
        for entry in pending:
            g = entry.grads[0] if len(entry.grads) == 1 else torch.cat(entry.grads)
            x = entry.inputs[0] if len(entry.inputs) == 1 else torch.cat(entry.inputs)
            if entry.weight.requires_grad:
                _accumulate(entry.weight, g.t(), x)
            _accumulate_bias(entry.bias, g)


class _AccumulatingLinear(torch.autograd.Function):
    """``F.linear`` whose backward accumulates the weight and bias gradients into their ``.grad`` itself.

    Autograd would compute each micro-batch's weight gradient into a new
    tensor and then add it to ``.grad``: a write, then a read of both and a
    write. One ``addmm_`` into ``.grad`` does the same sum with half the
    memory traffic, which is most of a small micro-batch's backward. With a
    :class:`WeightGradientStore` the weight gradient is left to it instead,
    once: a retained graph traversed again (zero-bubble's W, reaching another
    parameter through this op) computes the input gradient only. The weight
    and bias get ``None`` from autograd (nothing is counted twice), and the
    ``anchor``, when given, an empty gradient: asking autograd for the
    anchor's gradient runs the backward of every op that took it.
    """

    @staticmethod
    def forward(  # autograd passes a Function's inputs positionally
        ctx: FunctionCtx,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        store: WeightGradientStore | None,
        anchor: torch.Tensor | None,
    ) -> torch.Tensor:
        ctx.save_for_backward(x)
        ctx.weight, ctx.bias, ctx.store = weight, bias, store  # type: ignore[attr-defined]
        ctx.fused_params = (weight,) if bias is None else (weight, bias)  # type: ignore[attr-defined]
        ctx.anchored = anchor is not None  # type: ignore[attr-defined]
        return F.linear(x, weight, bias)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, None, None, None, torch.Tensor | None]:
        (x,) = ctx.saved_tensors
        weight, bias, store = ctx.weight, ctx.bias, ctx.store
        g = grad_out.reshape(-1, grad_out.shape[-1])
        rows = x.reshape(-1, x.shape[-1])
        if store is None:
            if weight.requires_grad:
                _accumulate(weight, g.t(), rows)
            _accumulate_bias(bias, g)
        elif not getattr(ctx, "stored", False):
            store.add(weight, bias, g, rows)
            ctx.stored = True
        grad_in = grad_out.matmul(weight) if ctx.needs_input_grad[0] else None
        return grad_in, None, None, None, grad_out.new_empty(0) if ctx.anchored else None


def fused_params(output: object) -> tuple[torch.Tensor, ...]:
    """The parameters whose gradients the fused op that computed ``output`` accumulates itself; () if none did."""
    grad_fn = output.grad_fn if isinstance(output, torch.Tensor) else None
    params: tuple[torch.Tensor, ...] = getattr(grad_fn, "fused_params", ())
    return params


class FusedWeightGradients(TorchFunctionMode):
    """Within this mode, linear ops on ``params`` accumulate their weight gradients into ``.grad`` in their backward.

    This is gradient-accumulation fusion (as in Megatron-LM): over ``m``
    micro-batches each linear weight's gradient is summed by ``m`` GEMMs that
    write into ``.grad``, instead of ``m`` GEMMs into new tensors and ``m``
    additions. The gradients are the same sums (equal up to rounding). With
    a ``store`` the weight gradients wait there until its ``flush``.

    With an ``anchor`` (an empty tensor that requires grad), every fused op
    takes it as an input, so that asking autograd for the anchor's gradient
    runs each fused op's backward, and so fills the store, even where no
    other requested gradient passes through it (zero-bubble's I).

    Only the forward needs the mode: what it records decides the backward.
    Ops under autocast or without grad mode run unchanged, as do those whose
    weight is outside ``params``, not a matrix or not requiring grad, whose
    input is one of ``params``, or whose bias is not one of ``own`` (the
    stage's parameters; by default ``params``: a received or computed bias
    gives its gradient to autograd) or not shaped ``(out,)``. Hooks on a fused parameter's
    gradient accumulator (``Tensor.register_hook``,
    ``register_post_accumulate_grad_hook``, DDP's reducer) do not see the
    gradients of fused backwards; run the backward they must see without
    the mode (see :class:`stagewise.Pipeline`).
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor],
        *,
        store: WeightGradientStore | None = None,
        anchor: torch.Tensor | None = None,
        own: frozenset[int] | None = None,
    ) -> None:
        super().__init__()
        self.ids = frozenset(id(p) for p in params)
        self.own = self.ids if own is None else own
        """The ``id`` of every parameter a fused op's bias may be."""
        self.store = store
        """Where backwards leave their weight gradients, when deferred; None accumulates them at once."""
        self.anchor = anchor
        """An input of every fused op, whose gradient request runs all their backwards (see above)."""

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Iterable[type],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func in LINEAR_OPS and torch.is_grad_enabled():
            x, weight, bias = _linear_arguments(args, kwargs)
            if (
                id(weight) in self.ids
                and weight.requires_grad
                and weight.dim() == 2  # a vector "weight" (F.linear(x, v)) is a dot product: autograd's
                # A bias that is not this stage's own parameter (a received or computed one) must give its gradient
                # to autograd, which sends it on; one shaped otherwise than (out,) broadcasts.
                and (bias is None or (id(bias) in self.own and bias.shape == weight.shape[:1]))
                and isinstance(x, torch.Tensor)
                and id(x) not in self.ids  # F.linear(w, w): the input's gradient is the weight's too
                and not torch.is_autocast_enabled(x.device.type)
            ):
                return _AccumulatingLinear.apply(x, weight, bias, self.store, self.anchor)  # type: ignore[no-untyped-call]
        return func(*args, **kwargs)


def _linear_arguments(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any, Any]:
    """``(input, weight, bias)`` of a call of ``F.linear`` or ``aten.linear``, however they were passed."""
    bound = dict(zip(("input", "weight", "bias"), args, strict=False)) | kwargs
    return bound.get("input"), bound.get("weight"), bound.get("bias")
