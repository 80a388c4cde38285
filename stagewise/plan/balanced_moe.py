"""Balanced routing: how the planner runs a mixture-of-experts layer to cost it, each routed expert given its even
share of the token choices, on the meta device as on a real one.

A real :class:`~stagewise.models.moe.MoE` routes by its router's scores: on the meta device those are not values
(its token counts cannot even be read), and on a real device at initialisation they are whatever the random
weights make them. The planner costs the layer by its config instead: the router and the shared experts as they
are, and the routed experts on ``tokens * top_k`` choices split as evenly as the experts allow (fewer where a
capacity drops some), as batched matmuls. Its FLOPs are then the ``top_k`` active experts', its parameters all of
them, and what it saves for backward that of a balanced step.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from stagewise.models.moe import MoE, MoEConfig, moe_layers
from stagewise.partition import layers_of


@dataclass(frozen=True)
class Routed:
    """What one MoE layer routed in its last balanced forward."""

    layer: int
    """The index of the model's layer (:func:`~stagewise.partition.layers_of`) that holds it."""
    tokens: int
    """Tokens of its input."""
    kept: int
    """Token choices that reached an expert: ``tokens * top_k``, fewer where the capacity dropped some."""
    width: int
    """The model's width (``d_model``)."""
    hidden: int
    """Each routed expert's hidden width."""
    element_bytes: int
    """Bytes of one element of its activations."""
    config: MoEConfig


_SEEN: dict[int, Routed] = {}
"""What each MoE layer, by the key :func:`balanced_routing` gave it, routed last."""


def kept_choices(config: MoEConfig, rows: int, length: int) -> int:
    """Token choices of ``rows`` sequences of ``length`` tokens that reach an expert under balanced routing: all
    ``rows * length * top_k`` of them dropless, else at most each expert's capacity per sequence."""
    choices = rows * length * config.top_k
    if not config.capacity_factor:
        return choices
    capacity = math.ceil(config.capacity_factor * length * config.top_k / config.experts)
    return min(choices, rows * config.experts * capacity)


def _experts(moe: MoE, choices: torch.Tensor) -> torch.Tensor:
    """The routed experts on ``choices`` (``[n, width]``), in expert order, ``n`` split as evenly as the experts
    allow: each SwiGLU expert as one batched matmul over the experts of the same share."""
    experts = moe.experts
    count = experts.gate.shape[0]
    share, extra = divmod(choices.shape[0], count)
    outs, start = [], 0
    for first, last, n in ((0, extra, share + 1), (extra, count, share)):
        if n == 0 or last == first:
            continue
        x = choices[start : start + (last - first) * n].reshape(last - first, n, -1)
        gated = F.silu(torch.bmm(x, experts.gate[first:last])) * torch.bmm(x, experts.up[first:last])
        outs.append(torch.bmm(gated, experts.down[first:last]).reshape(-1, choices.shape[1]))
        start += (last - first) * n
    return torch.cat(outs) if outs else choices.new_zeros(0, choices.shape[1])


def balanced_forward(moe: MoE, x: torch.Tensor, key: int) -> torch.Tensor:
    """``moe`` on ``x`` (``[rows, length, d_model]``) with balanced routing (see the module's docstring), its
    :class:`Routed` recorded under ``key``."""
    c = moe.config
    rows, length, width = x.shape
    flat = x.reshape(-1, width)
    tokens = flat.shape[0]
    scores = moe.router(flat)
    scores = scores.softmax(-1) if c.scoring == "softmax" else scores.sigmoid()
    weights = scores.topk(c.top_k, dim=-1).values
    if c.top_k > 1 or c.scoring == "sigmoid":
        weights = weights / weights.sum(-1, keepdim=True)
    kept = kept_choices(c, rows, length)
    choices = flat.repeat_interleave(c.top_k, dim=0)  # each token once per choice: what the dispatch moves
    routed = _experts(moe, choices[:kept])
    if kept < tokens * c.top_k:  # the choices past the capacity add nothing
        routed = torch.cat([routed, routed.new_zeros(tokens * c.top_k - kept, width)])
    out: torch.Tensor = (routed.reshape(tokens, c.top_k, width) * weights.unsqueeze(-1)).sum(1).reshape_as(x)
    if moe.shared is not None:
        out = out + moe.shared(x)
    layer = _SEEN[key].layer if key in _SEEN else -1
    hidden = int(moe.experts.gate.shape[-1])
    _SEEN[key] = Routed(layer, tokens, kept, width, hidden, x.element_size(), c)
    return out


class _Balanced(MoE):
    """An :class:`~stagewise.models.moe.MoE` that routes as :func:`balanced_forward` does, while it is costed."""

    _costing_key: int

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return balanced_forward(self, x, self._costing_key)


@contextlib.contextmanager
def balanced_routing(model: nn.Module) -> Iterator[dict[int, Routed]]:
    """Within it, every :class:`~stagewise.models.moe.MoE` of ``model``'s layers (and of copies made of them, as
    profiling makes) routes with balanced routing; yields what each routed last, by key (one per MoE layer, in
    module order), each tagged with the index of its layer. ``model`` is as it was afterwards."""
    found: list[tuple[int, MoE]] = []
    if any(isinstance(m, MoE) for m in model.modules()):
        found = [(index, moe) for index, layer in enumerate(layers_of(model)) for moe in moe_layers(layer.module)]
    saved = dict(_SEEN)
    _SEEN.clear()
    try:
        for key, (index, moe) in enumerate(found):
            if type(moe) is not MoE:
                raise TypeError(
                    f"cannot cost {type(moe).__name__}, a subclass of MoE whose routing the planner does not know, "
                    "with balanced routing; build the model's mixture-of-experts layers as stagewise.models.moe.MoE "
                    "to plan it"
                )
            object.__setattr__(moe, "__class__", _Balanced)  # plain attributes, which deep copies keep
            object.__setattr__(moe, "_costing_key", key)
            _SEEN[key] = Routed(index, 0, 0, 0, 0, 0, moe.config)
        yield _SEEN
    finally:
        for _, moe in found:
            if type(moe) is _Balanced:
                object.__delattr__(moe, "_costing_key")
                object.__setattr__(moe, "__class__", MoE)
        _SEEN.clear()
        _SEEN.update(saved)
