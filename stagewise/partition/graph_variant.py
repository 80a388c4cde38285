"""Variants of a captured segment's graph: on another device, in evaluation mode, with zero-bubble's W cuts; and
which of its ops behave differently in training."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import fx

DROPOUTS = frozenset(
    {torch.ops.aten.dropout.default, torch.ops.aten.feature_dropout.default, torch.ops.aten.alpha_dropout.default}
)
"""Dropout ops whose third argument says whether they drop (``train``): a graph captured in training mode runs
in evaluation mode with it False."""
_ATTENTION = torch.ops.aten.scaled_dot_product_attention.default
_ATTENTION_DROPOUT = 4
"""Where scaled_dot_product_attention takes ``dropout_p``: a model passes its rate in training and 0 in eval, so a
graph captured in training mode has the rate burned in."""
_HISTC = torch.ops.aten.histc.default
_FLOAT_HISTC = frozenset({"cpu", "mps"})
"""Devices whose histc counts floating-point values only; CUDA's counts integers too (and only those with
deterministic algorithms), so a graph captured on the meta device may count integers, as Hugging Face's grouped
experts do everywhere but on these."""


def depends_on_the_mode(node: fx.Node) -> bool:
    """Whether ``node`` behaves as the training mode of the capture says: a dropout or a batch norm (see
    :data:`MODE_DEPENDENT`), or an attention that drops (``dropout_p > 0``)."""
    if node.target is _ATTENTION:
        rate = node.args[_ATTENTION_DROPOUT] if len(node.args) > _ATTENTION_DROPOUT else node.kwargs.get("dropout_p")
        return isinstance(rate, float) and rate > 0
    return node.target in MODE_DEPENDENT


MODE_DEPENDENT = frozenset(
    {
        torch.ops.aten.dropout.default,
        torch.ops.aten.native_dropout.default,
        torch.ops.aten.feature_dropout.default,
        torch.ops.aten.alpha_dropout.default,
        torch.ops.aten.batch_norm.default,
        torch.ops.aten._native_batch_norm_legit_functional.default,
        torch.ops.aten._native_batch_norm_legit_no_training.default,
    }
)
"""Ops whose behaviour was fixed by the training mode the model had when it was captured."""


def only_dropout_depends_on_the_mode(module: fx.GraphModule) -> bool:
    """Whether every op of ``module`` that behaves differently in training drops: a dropout (see
    :data:`DROPOUTS`) or an attention with a dropout rate."""
    return all(
        node.target in DROPOUTS or node.target is _ATTENTION for node in module.graph.nodes if depends_on_the_mode(node)
    )


def variant(
    module: fx.GraphModule,
    *,
    old: torch.device,
    new: torch.device,
    also_return: Sequence[str] = (),
    dropout_off: bool = False,
    cut: Cut | None = None,
) -> fx.GraphModule:
    """A copy of ``module`` whose ops that create tensors on ``old`` (burned in by the capture) create them on
    ``new``, and that also returns the values of the nodes named ``also_return``, after its own outputs; with
    ``dropout_off``, its dropouts pass their input through (evaluation mode). With ``cut``, those nodes take
    each input that is not one of the ``cut.state`` state placeholders through ``cut.through``, where
    zero-bubble's W stops: W from a use of a parameter reaches that parameter through this use alone."""
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    by_name: dict[str, fx.Node] = {}
    placeholders = [n for n in module.graph.nodes if n.op == "placeholder"]
    state = set(placeholders[: cut.state]) if cut is not None else set()
    marked = set(also_return) if cut is not None else set()

    def through_cut(arg: fx.Node) -> fx.Node:
        value = env[arg]
        if arg in state or not isinstance(arg.meta.get("val"), torch.Tensor):
            return value
        assert cut is not None
        return g.call_function(cut.through, (value,))

    for node in module.graph.nodes:
        if node.op == "output":
            values = node.args[0]
            assert isinstance(values, tuple)
            g.output((*(env[v] for v in values), *(by_name[n] for n in also_return)))
            continue
        copy = g.node_copy(node, through_cut if node.name in marked else env.__getitem__)
        _move(copy, old, new)
        if dropout_off:
            _drop_nothing(copy, node)
        result = _count_as_floats(g, copy, node) if new.type in _FLOAT_HISTC else copy
        env[node] = result
        by_name[node.name] = result
    return fx.GraphModule(module, g, class_name=type(module).__name__)


@dataclass(frozen=True)
class Cut:
    """Where zero-bubble's W stops in a segment's graph (see :func:`variant`)."""

    through: Callable[[torch.Tensor], torch.Tensor]
    """The identity whose backward passes gradients on, except during W."""
    state: int
    """How many of the graph's first placeholders are its state (parameters, buffers, constants)."""


def _move(copy: fx.Node, old: torch.device, new: torch.device) -> None:
    """Make ``copy`` create its tensors on ``new`` where the capture burned in ``old``."""
    device = copy.kwargs.get("device")
    if isinstance(device, (torch.device, str)) and torch.device(device) == old:
        copy.kwargs = {**copy.kwargs, "device": new}
    if any(isinstance(a, torch.device) and a == old for a in copy.args):  # aten.to.device takes it by position
        copy.args = tuple(new if isinstance(a, torch.device) and a == old else a for a in copy.args)


def _count_as_floats(g: fx.Graph, copy: fx.Node, node: fx.Node) -> fx.Node:
    """For ``copy`` of a histc of integers, on a device whose histc counts floats only: the same counts, of the
    values as floats (exact below 2**24), in the integer dtype the graph expects; any other node as it is."""
    value = node.args[0] if node.target is _HISTC and node.args else None
    counted = value.meta.get("val") if isinstance(value, fx.Node) else None
    if not isinstance(counted, torch.Tensor) or counted.is_floating_point():
        return copy
    with g.inserting_before(copy):
        as_float = g.call_function(torch.ops.aten._to_copy.default, (copy.args[0],), {"dtype": torch.float32})
    copy.args = (as_float, *copy.args[1:])
    return g.call_function(torch.ops.aten._to_copy.default, (copy,), {"dtype": counted.dtype})


def _drop_nothing(copy: fx.Node, node: fx.Node) -> None:
    """Make ``copy`` of a dropout, or of an attention with a dropout rate, drop nothing (evaluation mode)."""
    if node.target in DROPOUTS:
        copy.args = (*copy.args[:2], False)
    elif node.target is _ATTENTION and depends_on_the_mode(node):
        if len(copy.args) > _ATTENTION_DROPOUT:
            copy.args = (*copy.args[:_ATTENTION_DROPOUT], 0.0, *copy.args[_ATTENTION_DROPOUT + 1 :])
        else:
            copy.kwargs = {**copy.kwargs, "dropout_p": 0.0}
