"""Count scaled-dot-product attention as the fused kernel that real devices run, on every device."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils import flop_counter

aten = torch.ops.aten


def _same_as(op: Any) -> Callable[..., int]:
    """The formula torch registered for ``op``, already taking raw arguments."""
    formula = flop_counter.flop_registry[op]

    def count(*args: Any, **kwargs: Any) -> int:
        return int(formula(*args, **kwargs))

    count._get_raw = True  # type: ignore[attr-defined]  # FlopCounterMode's flag: do not wrap again
    return count


FLOP_FORMULAS: dict[Any, Callable[..., int]] = {
    # torch's counter knows the CUDA fused kernels but not the CPU flash kernel, which has the same shape.
    aten._scaled_dot_product_flash_attention_for_cpu: _same_as(aten._scaled_dot_product_flash_attention),
    aten._scaled_dot_product_flash_attention_for_cpu_backward: _same_as(
        aten._scaled_dot_product_flash_attention_backward
    ),
}
"""Extra formulas for ``FlopCounterMode(custom_mapping=...)``."""


_ATTENTION = (F.scaled_dot_product_attention, aten.scaled_dot_product_attention.default)
"""Attention as a model calls it, and as a captured graph (:func:`stagewise.partition.capture`) calls it."""


class FusedAttentionOnMeta(TorchFunctionMode):
    """Runs ``scaled_dot_product_attention`` on meta tensors through the fused kernels' meta versions.

    On the meta device torch falls back to the unfused math path, which saves
    the whole attention matrix for backward; GPUs and CPUs run a fused kernel
    that saves only the output and the log-sum-exp, and recomputes the rest.
    Under this mode meta profiling counts what the fused kernel does. Grouped-query attention
    (``enable_gqa``) runs the kernel on keys and values repeated to the query heads' number: the same FLOPs,
    and saved bytes that count the repeated keys and values (a native kernel saves them unrepeated).
    """

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Sequence[type],
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        kwargs = dict(kwargs or {})
        if func not in _ATTENTION:
            return func(*args, **kwargs)
        names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
        bound = dict(zip(names, args, strict=False)) | kwargs  # passed by position or by name alike
        query = bound.get("query")
        if not isinstance(query, torch.Tensor) or query.device.type != "meta":
            return func(*args, **kwargs)
        q, k, v = bound["query"], bound["key"], bound["value"]
        if bound.get("enable_gqa", False) and k.dim() >= 3 and v.dim() >= 3:
            # Grouped-query attention: each key/value head serves a group of query heads. Counted as the fused
            # kernel on key/value heads repeated to the query heads' number: the same FLOPs, no T x T matrix.
            k, v = _repeat_heads(q, k, v)
        dropout = float(bound.get("dropout_p", 0.0))
        causal = bool(bound.get("is_causal", False))
        scale = bound.get("scale")
        mask = bound.get("attn_mask")
        if mask is None:
            return aten._scaled_dot_product_flash_attention(q, k, v, dropout, causal, scale=scale)[0]
        needs_grad = q.requires_grad or k.requires_grad or v.requires_grad
        return aten._scaled_dot_product_efficient_attention(q, k, v, mask, needs_grad, dropout, causal, scale=scale)[0]


def _repeat_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values repeated to the query's heads (dimension -3), each by its own factor, as torch does.

    Raises:
        ValueError: the query's heads are not a multiple of the key's or the value's, which
            ``scaled_dot_product_attention(..., enable_gqa=True)`` refuses on every device.
    """
    heads, key_heads, value_heads = q.size(-3), k.size(-3), v.size(-3)
    if not key_heads or not value_heads:  # nothing to attend to: torch's kernels take it as it is
        return k, v
    if heads % key_heads or heads % value_heads:
        raise ValueError(
            f"grouped-query attention (enable_gqa=True) needs the query's heads to be a multiple of the key's and "
            f"the value's, got {heads} query heads, {key_heads} key heads and {value_heads} value heads (query "
            f"{list(q.shape)}, key {list(k.shape)}, value {list(v.shape)}); give keys and values a number of heads "
            f"that divides {heads}"
        )
    if key_heads != heads:
        k = k.repeat_interleave(heads // key_heads, dim=-3)
    if value_heads != heads:
        v = v.repeat_interleave(heads // value_heads, dim=-3)
    return k, v
