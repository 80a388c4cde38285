"""Tensor parallelism for captured graphs: a segment's parameters made DTensors over the ``tp`` ranks as a
path-keyed plan says, and its graph run on DTensors.

A captured model's layers are graphs of aten ops (:class:`~stagewise.partition.segment.Segment`), which call
their ops directly, not through the modules that torch's parallel styles hook. Here each planned parameter is
distributed over the ``tp`` mesh (the others replicated), and the graph runs on DTensors: its inputs enter as
replicated DTensors, DTensor propagates every op's sharding (global shapes keep the graph's reshapes valid), the
tensors the graph makes itself (masks, positions) and its buffers enter replicated, and its outputs leave whole
(plain tensors), since they travel to the next stage as they are.

Where a parameter is split depends on how the graph uses it, not on its name: the weight of ``aten.linear``
(``nn.Linear``, stored ``[out, in]``) splits its rows for "colwise" and its columns for "rowwise"; the weight of
``aten.addmm``/``mm``/``matmul`` (GPT-2's ``Conv1D``, stored ``[in, out]``) the other way round; the table of
``aten.embedding`` its rows for "rowwise" and its columns for "colwise"; a 1-D parameter (a bias) is split for
"colwise" and whole for "rowwise". The plan's style of a use is that of the module the op belongs to (the graph
records it), so a weight tied between an embedding and a head takes each module's style.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

import torch
from torch import fx, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.experimental import implicit_replication

from stagewise.errors import StagewiseError
from stagewise.partition import Layer
from stagewise.partition.layers import Payload, SharedParameter
from stagewise.partition.segment import Segment
from stagewise.pipeline.config import TensorParallelStyle
from stagewise.pipeline.parallel.tensor_plan import PathPlan, Split, TensorPlanError, split_of

log = logging.getLogger(__name__)

aten = torch.ops.aten

Layout = Literal["out_in", "in_out", "table"]
"""How an op reads a 2-D weight: ``aten.linear``'s ``[out, in]``, a matmul's ``[in, out]``, an embedding's table."""

_SHARD_DIM: dict[tuple[Layout, Split], int] = {
    ("out_in", "colwise"): 0, ("out_in", "rowwise"): 1,
    ("in_out", "colwise"): 1, ("in_out", "rowwise"): 0,
    ("table", "rowwise"): 0, ("table", "colwise"): 1,
}  # fmt: skip


class CapturedSplitError(StagewiseError, RuntimeError):
    """A captured layer split over the ``tp`` ranks that DTensor cannot run: an op without a sharding rule for
    the placements it gets; the message names the layer and the op's error."""


@dataclass(frozen=True)
class SegmentSplit:
    """Where each parameter of one captured layer is split over the ``tp`` ranks."""

    layer: str
    """The layer's name (``model.layers.3``)."""
    dims: Mapping[str, int | None]
    """Every name of each of its parameters (the unsplit model's) -> the dimension split, or None (whole)."""

    @property
    def splits(self) -> bool:
        """Whether any of its parameters is split (else the layer runs as it is, whole on every ``tp`` rank)."""
        return any(dim is not None for dim in self.dims.values())


def _layout(use: fx.Node, node: fx.Node) -> Layout | None:
    """How ``use`` reads the weight ``node``; None for an op whose split stagewise does not place."""
    args = use.args
    if use.target is aten.linear.default and len(args) > 1 and args[1] is node:
        return "out_in"
    if (use.target is aten.addmm.default and len(args) > 2 and args[2] is node) or (
        use.target in (aten.mm.default, aten.matmul.default) and len(args) > 1 and args[1] is node
    ):
        return "in_out"
    if use.target is aten.embedding.default and args and args[0] is node:
        return "table"
    return None


def _module_of(use: fx.Node) -> str | None:
    """The path of the module whose forward ran ``use`` (torch.export records it), or None."""
    stack = use.meta.get("nn_module_stack")
    if not stack:
        return None
    innermost = list(stack.values())[-1]
    path = innermost[0] if isinstance(innermost, tuple) else None
    return path if isinstance(path, str) else None


@dataclass(frozen=True)
class _Parameter:
    """One parameter of a segment as the analysis sees it."""

    graph_name: str
    names: tuple[str, ...]
    shape: tuple[int, ...]
    uses: tuple[fx.Node, ...]
    node: fx.Node | None


def _style(plan: PathPlan, param: _Parameter, use: fx.Node | None) -> TensorParallelStyle | None:
    """The style of ``param`` for ``use``: the plan's for its name under the module that runs ``use``."""
    module = _module_of(use) if use is not None else None
    name = next((n for n in param.names if module is not None and n.rpartition(".")[0] == module), param.graph_name)
    return plan.style_of(name)


def _dim(plan: PathPlan, param: _Parameter, use: fx.Node | None, layer: str) -> int | None:
    style = _style(plan, param, use)
    if style is None or split_of(style) == "replicate":
        return None
    split = split_of(style)
    if len(param.shape) == 1:
        return 0 if split == "colwise" else None
    layout = _layout(use, param.node) if use is not None and param.node is not None else None
    if len(param.shape) != 2 or layout is None:
        op = use.target if use is not None else "no op"
        raise TensorPlanError(
            f"{plan.source} splits {param.graph_name} {style!r}, but layer {layer} reads it with {op} (shape "
            f"{list(param.shape)}), whose split stagewise cannot place (it places the weights of aten.linear, "
            "aten.addmm, aten.mm, aten.matmul and aten.embedding, and 1-D parameters); map it to 'replicate'"
        )
    return _SHARD_DIM[(layout, split)]


def _parameters(segment: Segment) -> list[_Parameter]:
    names: dict[int, list[str]] = {}
    tensors: dict[int, nn.Parameter] = {}
    for name, param in segment.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
        tensors[id(param)] = param
    by_name = {name: key for key, aliases in names.items() for name in aliases}
    placeholders = [n for n in segment.graph.module.graph.nodes if n.op == "placeholder"]
    nodes = {fqn: placeholders[i] for i, fqn in enumerate(segment.graph.state) if fqn in by_name}
    out = []
    for key, aliases in names.items():
        graph_name = next((n for n in aliases if n in nodes), aliases[0])
        node = nodes.get(graph_name)
        uses = tuple(node.users) if node is not None else ()
        out.append(_Parameter(graph_name, tuple(aliases), tuple(tensors[key].shape), uses, node))
    return out


def segment_split(segment: Segment, layer: str, plan: PathPlan, tp: int) -> SegmentSplit:
    """Where ``plan`` splits each parameter of the captured ``layer`` over ``tp`` ranks (``segment`` may be on the
    meta device: only its graph and shapes are read).

    Raises:
        TensorPlanError: a parameter whose uses the plan splits unalike (a weight tied between an embedding and a
            head given different splits), one read by an op whose split stagewise does not place, or a dimension
            ``tp`` does not divide.
    """
    dims: dict[str, int | None] = {}
    for param in _parameters(segment):
        found = (
            {_dim(plan, param, use, layer) for use in param.uses} if param.uses else {_dim(plan, param, None, layer)}
        )
        if len(found) > 1:
            raise TensorPlanError(
                f"{plan.source} splits {param.graph_name} (also named {list(param.names)}) unalike in its uses in "
                f"layer {layer} (dimensions {sorted(found, key=str)}, None: whole); give the modules that share it "
                "styles that split it alike, or 'replicate'"
            )
        dim = found.pop()
        if dim is not None and param.shape[dim] % tp:
            size = param.shape[dim]
            fits = [d for d in range(1, size + 1) if size % d == 0]
            raise TensorPlanError(
                f"tp={tp} does not divide dimension {dim} (size {size}) of {param.graph_name}, which {plan.source} "
                f"splits; choose tp among {fits}, or map it to 'replicate'"
            )
        dims.update(dict.fromkeys(param.names, dim))
    return SegmentSplit(layer, dims)


def check_ties(layers: Sequence[Layer], shared: Sequence[SharedParameter], splits: Mapping[int, SegmentSplit]) -> None:
    """Refuse a parameter tied between captured layers (an embedding and a head on different stages) that the
    plan splits unalike in them: each stage holds a copy, and the copies must be split alike to stay one
    parameter."""
    for tie in shared:
        found = {
            (layers[i].name, splits[i].dims.get(name))
            for i, name in zip(tie.indices, tie.names, strict=True)
            if i in splits
        }
        if len({dim for _, dim in found}) > 1:
            raise TensorPlanError(
                f"the tied parameter {tie.names[0]} is split unalike by its layers: {sorted(found, key=str)} "
                "(layer, dimension; None: whole); give its modules styles that split it alike (e.g. "
                "'embedding_rowwise' for the embedding and 'colwise' for the head), or 'replicate' in both"
            )


_ATTENTION_RULES: list[bool] = []
"""Whether the DTensor sharding rules of CPU attention are registered (once per process)."""


def _register_cpu_attention() -> None:
    """Give DTensor sharding rules for the fused attention of CPUs (``_scaled_dot_product_flash_attention_for_cpu``
    and its backward), which it has for GPUs' kernels only: by heads, by batch, or whole; the mask split alike where
    it has that dimension, else whole. Without them DTensor propagates through the op's decomposition, which takes
    seconds per call."""
    if _ATTENTION_RULES:
        return
    from torch.distributed.tensor.experimental import register_sharding

    def mask(attn_mask: Any, dim: int) -> list[Placement]:
        if attn_mask is None:
            return []
        return [Shard(dim) if attn_mask.shape[dim] > 1 else Replicate()]

    def rules(outputs: int, inputs: int, attn_mask: Any) -> list[tuple[list[Placement], list[Placement]]]:
        whole: list[Placement] = [Replicate()]
        out = [(whole * outputs, whole * (inputs + (attn_mask is not None)))]
        for dim in (1, 0):  # heads, batch
            split: list[Placement] = [Shard(dim)]
            out.append((split * outputs, split * inputs + mask(attn_mask, dim)))
        return out

    @register_sharding(aten._scaled_dot_product_flash_attention_for_cpu.default)  # type: ignore[untyped-decorator]
    def forward(query: Any, key: Any, value: Any, *args: Any, attn_mask: Any = None, **kwargs: Any) -> Any:
        return rules(2, 3, attn_mask)

    @register_sharding(aten._scaled_dot_product_flash_attention_for_cpu_backward.default)  # type: ignore[untyped-decorator]
    def backward(*args: Any, attn_mask: Any = None, **kwargs: Any) -> Any:
        return rules(3, 6, attn_mask)

    _ATTENTION_RULES.append(True)


def _replicating(mesh: DeviceMesh) -> Callable[[object], object]:
    placements = [Replicate()] * mesh.ndim

    def replicated(value: object) -> object:
        if isinstance(value, torch.Tensor) and not isinstance(value, DTensor):
            return DTensor.from_local(value, mesh, placements, run_check=False)
        return value

    return replicated


def _makes_a_tensor_from_nothing(node: fx.Node) -> bool:
    """Whether ``node`` makes a tensor from no tensor of the graph (``arange``, ``full``, ...): a plain tensor
    that DTensor ops would meet in the backward, outside any implicit replication."""
    return (
        node.op == "call_function"
        and isinstance(node.meta.get("val"), torch.Tensor)
        and not any(isinstance(arg.meta.get("val"), torch.Tensor) for arg in node.all_input_nodes)
    )


def _on_dtensors(segment: Segment, mesh: DeviceMesh) -> fx.GraphModule:
    """``segment``'s graph with its buffers, constants and the tensors it makes from nothing turned into
    replicated DTensors where they enter (its parameters are DTensors already, its inputs are made so)."""
    module = segment.graph.module
    parameters = {name for name, _ in segment.named_parameters(remove_duplicate=False)}
    replicated = _replicating(mesh)
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    position = 0
    for node in module.graph.nodes:
        copy = graph.node_copy(node, env.__getitem__)
        env[node] = copy
        plain_state = node.op == "placeholder" and position < len(segment.graph.state)
        if plain_state and segment.graph.state[position] in parameters:
            plain_state = False
        if node.op == "placeholder":
            position += 1
        if plain_state or _makes_a_tensor_from_nothing(node):
            env[node] = graph.call_function(replicated, (copy,))
    return fx.GraphModule(module, graph, class_name=type(module).__name__)


def _whole(value: object) -> object:
    return value.full_tensor() if isinstance(value, DTensor) else value


def _run_on_dtensors(segment: Segment, mesh: DeviceMesh, tp: int) -> Callable[[Payload], object]:
    """``segment``'s forward on DTensors: inputs replicated, outputs made whole; an op DTensor cannot run is
    refused naming the layer."""
    forward = segment.forward
    replicated = _replicating(mesh)

    def split_forward(x: Payload) -> object:
        inputs: Any = replicated(x) if isinstance(x, torch.Tensor) else tuple(replicated(t) for t in x)
        try:
            with implicit_replication():
                out = forward(inputs)
        except (NotImplementedError, RuntimeError) as err:
            message = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            if isinstance(err, RuntimeError) and "DTensor" not in str(err) and "sharding" not in str(err):
                raise
            raise CapturedSplitError(
                f"layer {segment.segment_name}, split over tp={tp}, runs an op DTensor cannot run on its split "
                f"parameters: {type(err).__name__}: {message}; map the parameters that op reads to 'replicate' "
                "in the plan, or train this model with tp=1"
            ) from err
        if isinstance(out, torch.Tensor):
            return _whole(out)
        return tuple(_whole(value) for value in out)

    return split_forward


def split_segment(segment: Segment, split: SegmentSplit, mesh: DeviceMesh) -> None:
    """Make ``segment`` (materialised) run split over the 1-D ``mesh`` as ``split`` says: each parameter a DTensor
    (split or replicated) held wherever the segment holds it, the graph run on DTensors, outputs whole."""
    _register_cpu_attention()
    made: dict[int, nn.Parameter] = {}
    for name, param in list(segment.named_parameters(remove_duplicate=False)):
        if id(param) not in made:
            dim = split.dims[name]
            placements: list[Placement] = [Replicate()] if dim is None else [Shard(dim)]
            tensor = distribute_tensor(param.detach(), mesh, placements, src_data_rank=None)
            made[id(param)] = nn.Parameter(tensor, requires_grad=param.requires_grad)
        parent, _, leaf = name.rpartition(".")
        setattr(segment.get_submodule(parent) if parent else segment, leaf, made[id(param)])
    segment.graph = replace(segment.graph, module=_on_dtensors(segment, mesh))
    segment._variants.clear()  # built again from the graph above, on first use
    segment.__dict__["forward"] = _run_on_dtensors(segment, mesh, mesh.size())
    log.debug("layer %s runs on DTensors over %d tp ranks", split.layer, mesh.size())
