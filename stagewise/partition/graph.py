"""Segment graphs: an exported graph cut at its marker ops (cut) into pure graphs that pass their live values on."""

from __future__ import annotations

import logging
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import fx

from stagewise.errors import StagewiseError
from stagewise.partition.graph_variant import depends_on_the_mode

if TYPE_CHECKING:  # torch.export and torch.distributed.pipelining import dynamo: seconds, only when capturing
    from torch.export import ExportedProgram

log = logging.getLogger(__name__)


def marker() -> Any:
    """The op that ``torch.distributed.pipelining.pipe_split()`` leaves in a captured graph: a segment boundary."""
    import torch.distributed.pipelining

    return torch.ops.pippy._pipe_split.default


_SIZE = torch.ops.aten.sym_size.int
_DROPPED = (torch.ops.aten._assert_tensor_metadata.default,)
"""Ops left out of segments: metadata checks that pin the capturing device."""
_BOOKKEEPING = (_SIZE, *_DROPPED)
"""Ops that do no work: a segment made only of these (and getitem) is merged into the next one."""


class CaptureError(StagewiseError, TypeError):
    """A model that torch.export cannot capture, or whose graph stagewise cannot cut into a chain."""


@dataclass(frozen=True)
class SegmentGraph:
    """One segment of a cut graph: a pure function of the state it reads and the values it receives."""

    module: fx.GraphModule
    """Placeholders: the ``state`` tensors, then the received values; outputs: the emitted values,
    then the new values of the ``mutated`` buffers."""
    state: tuple[str, ...]
    """Fully qualified names of the parameters, buffers and constants it reads, in placeholder order."""
    receives: int
    """How many values it receives (for the first segment: the model's inputs)."""
    emits: int
    """How many values it passes on (for the last segment: the model's outputs)."""
    mutated: tuple[str, ...]
    """Buffers whose new value it computes (running statistics), in output order after the emitted values."""
    mode_dependent: bool
    """Whether it contains dropout or batch norm, fixed to the training mode of the capture."""
    uses: tuple[StateUse, ...]
    """Every op that reads state directly, in graph order: where weight gradients start."""


@dataclass(frozen=True)
class StateUse:
    """An op of a segment that reads some of its state tensors directly."""

    node: str
    """The op's node name in the segment's graph."""
    state: tuple[int, ...]
    """Positions, in :attr:`SegmentGraph.state`, of the tensors it reads."""


def _kind_of_inputs(ep: ExportedProgram) -> tuple[dict[str, str], list[str]]:
    """Placeholder name -> state FQN for parameters, buffers and constants; and the user inputs in order."""
    from torch.export.graph_signature import InputKind

    state: dict[str, str] = {}
    users: list[str] = []
    for spec in ep.graph_signature.input_specs:
        name = getattr(spec.arg, "name", None)
        if spec.kind == InputKind.USER_INPUT and name is not None:
            users.append(name)
        elif spec.kind in (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR):
            assert name is not None and spec.target is not None
            state[name] = spec.target
        else:
            raise CaptureError(
                f"the captured graph takes an input of kind {spec.kind.name} ({spec.arg}); stagewise splits models "
                "whose inputs are tensors and whose state is parameters, buffers and tensor constants"
            )
    return state, users


def _kind_of_outputs(ep: ExportedProgram, output: fx.Node) -> tuple[list[fx.Node], dict[fx.Node, str]]:
    """The user outputs' nodes in order, and buffer-mutation output node -> buffer FQN."""
    from torch.export.graph_signature import OutputKind

    values = output.args[0]
    assert isinstance(values, (tuple, list))
    user: list[fx.Node] = []
    mutations: dict[fx.Node, str] = {}
    for spec, node in zip(ep.graph_signature.output_specs, values, strict=True):
        if not isinstance(node, fx.Node):
            raise CaptureError(f"the model returns a constant ({node!r}); return tensors only")
        if spec.kind == OutputKind.USER_OUTPUT:
            user.append(node)
        elif spec.kind == OutputKind.BUFFER_MUTATION:
            assert spec.target is not None
            mutations[node] = spec.target
        else:
            raise CaptureError(
                f"the captured graph has an output of kind {spec.kind.name}; stagewise splits models that "
                "return tensors and update at most their buffers (not their inputs or parameters)"
            )
    return user, mutations


def _is_tensor(node: fx.Node) -> bool:
    return isinstance(node.meta.get("val"), torch.Tensor)


def _is_size(node: fx.Node) -> bool:
    return isinstance(node.meta.get("val"), (torch.SymInt, int)) and node.op == "call_function"


def _works(node: fx.Node) -> bool:
    return node.target not in _BOOKKEEPING and node.target is not operator.getitem


def _assign(graph: fx.Graph, boundary_names: Sequence[str]) -> tuple[dict[fx.Node, int], list[str]]:
    """Each compute node's segment, and each segment's name.

    A marker starts a new segment, named after the block it marks, unless the
    segment before it did no work: that one then starts at the marker instead.
    """
    boundary = marker()
    segment: dict[fx.Node, int] = {}
    names = ["<input>"]
    working, seen = False, 0
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        if node.target == boundary:
            if working:
                names.append(boundary_names[seen])
                working = False
            else:
                names[-1] = boundary_names[seen]
            seen += 1
            continue
        segment[node] = len(names) - 1
        working = working or _works(node)
    return segment, names


@dataclass(frozen=True)
class _Program:
    """An exported program's graph as cutting reads it."""

    gm: fx.GraphModule
    state_of: dict[str, str]
    """Placeholder name -> FQN of the parameter, buffer or constant it stands for."""
    placeholders: dict[str, fx.Node]
    """Every placeholder, by name."""
    user_inputs: list[fx.Node]
    """The placeholders of the model's inputs, in order."""
    user_outputs: list[fx.Node]
    """The nodes of the model's outputs, in order."""
    mutations: dict[fx.Node, str]
    """Buffer-mutation output node -> the buffer's FQN."""


def _read(ep: ExportedProgram, outputs: Sequence[int] | None) -> _Program:
    """``ep``'s graph, its state and inputs, its outputs (those at ``outputs``, or all) and buffer updates;
    refused where cutting cannot handle them."""
    graph = ep.graph_module.graph
    state_of, user_inputs = _kind_of_inputs(ep)
    placeholders = {n.name: n for n in graph.nodes if n.op == "placeholder"}
    (output,) = [n for n in graph.nodes if n.op == "output"]
    user_outputs, mutations = _kind_of_outputs(ep, output)
    if outputs is not None:
        user_outputs = [user_outputs[i] for i in outputs]
    inputs = [placeholders[n] for n in user_inputs]
    return _Program(ep.graph_module, state_of, placeholders, inputs, user_outputs, mutations)


@dataclass(frozen=True)
class _Lifetimes:
    """Where each value is defined and last used, by segment; the model's inputs count as defined before
    segment 0, and its outputs as used after the last segment."""

    inputs: list[fx.Node]
    defined: dict[fx.Node, int]
    last_use: dict[fx.Node, int]

    def live_into(self, k: int) -> list[fx.Node]:
        """Values crossing into segment ``k``, in graph order."""
        if k == 0:
            return list(self.inputs)
        return [
            v
            for v in self.defined
            if self.defined[v] < k <= self.last_use.get(v, -2) and (_is_tensor(v) or not _is_size(v))
        ]


def _lifetimes(program: _Program, segment: dict[fx.Node, int], n_segments: int) -> _Lifetimes:
    """Each value's defining and last using segment; refuses outputs not computed from the inputs, and values
    other than tensors and sizes that cross a boundary."""
    defined: dict[fx.Node, int] = dict.fromkeys(program.user_inputs, -1)
    defined.update(segment)
    last_use: dict[fx.Node, int] = {}
    for node in program.gm.graph.nodes:
        if node in segment:
            for arg in node.all_input_nodes:
                if arg in defined:
                    last_use[arg] = max(last_use.get(arg, -1), segment[node])
    for node in program.user_outputs:  # a buffer's new value is stored where it is computed, not passed on
        last_use[node] = n_segments
    for node in [*program.user_outputs, *program.mutations]:
        if node not in defined:
            raise CaptureError(f"the model returns {node.name}, which is not computed from its inputs; return tensors")
    for v, where in defined.items():
        if not (_is_tensor(v) or _is_size(v)) and last_use.get(v, -2) > where:
            raise CaptureError(
                f"{v.name} ({type(v.meta.get('val')).__name__}) crosses a segment boundary; only tensors and "
                "sizes can: pass tensors between the model's blocks"
            )
    return _Lifetimes(program.user_inputs, defined, last_use)


def cut(
    ep: ExportedProgram, *, boundary_names: Sequence[str], outputs: Sequence[int] | None = None
) -> tuple[list[SegmentGraph], list[str]]:
    """Cut ``ep``'s graph at its marker ops into segments that form a chain.

    Segment ``k`` receives every value that an earlier segment (or the model's
    input) defines and segment ``k`` or a later one uses, and emits those that
    later segments still need: a mask or a skip connection is passed along
    from stage to stage. Sizes (symbolic integers) never cross a boundary;
    each segment reads them again from a tensor it received.

    Returns the segments and their names: the name of the block whose marker
    starts each (``boundary_names[i]`` for marker ``i``); a first segment that
    starts before any marker is named ``"<input>"``. The last segment returns
    the model's outputs at positions ``outputs`` of its flat outputs (all of
    them by default); what computes only the others is dropped.
    """
    program = _read(ep, outputs)
    graph = program.gm.graph
    boundary = marker()
    segment, names = _assign(graph, boundary_names)
    n_segments = len(names)
    lifetimes = _lifetimes(program, segment, n_segments)
    segments: list[SegmentGraph] = []
    for k in range(n_segments):
        incoming = lifetimes.live_into(k)
        outgoing = program.user_outputs if k == n_segments - 1 else lifetimes.live_into(k + 1)
        mine = [n for n in graph.nodes if segment.get(n) == k and n.target not in _DROPPED and n.target != boundary]
        segments.append(_build(k, mine, incoming=incoming, outgoing=outgoing, program=program))
        log.debug("segment %d (%s): receives %d, emits %d", k, names[k], len(incoming), len(outgoing))
    return segments, names


class _SegmentBuilder:
    """The graph of one segment, built node by node: its placeholders, then copies of its nodes."""

    def __init__(self, k: int) -> None:
        self.k = k
        self.g = fx.Graph()
        self.env: dict[fx.Node, fx.Node] = {}
        """Node of the exported graph -> its copy here."""
        self.received: list[fx.Node] = []
        """The placeholders of the values the segment receives."""

    def placeholder(self, name: str, node: fx.Node) -> fx.Node:
        """A placeholder named ``name`` that stands for ``node`` of the exported graph."""
        new = self.g.placeholder(name)
        new.meta = dict(node.meta)
        self.env[node] = new
        return new

    def lookup(self, node: fx.Node) -> fx.Node:
        """``node``'s copy here; a size another segment computed is read again from a received tensor."""
        return self.env[node] if node in self.env else self._size_here(node)

    def _size_here(self, node: fx.Node) -> fx.Node:
        """A size another segment computed, read again from a tensor this segment received."""
        if node in self.env:
            return self.env[node]
        if node.target == _SIZE:
            want = node.meta["val"]
            for source in self.received:
                val = source.meta.get("val")
                if isinstance(val, torch.Tensor):
                    for dim, size in enumerate(val.shape):
                        if str(size) == str(want):
                            self.env[node] = self.g.call_function(_SIZE, (source, dim))
                            self.env[node].meta = dict(node.meta)
                            return self.env[node]
            raise CaptureError(
                f"segment {self.k} needs the size {want} ({node.name}) but receives no tensor with a dimension of "
                "that size; compute sizes from the tensors each block receives"
            )
        if node.op == "call_function" and all(_is_size(a) for a in node.all_input_nodes):
            self.env[node] = self.g.node_copy(node, self._size_here)
            return self.env[node]
        raise CaptureError(f"segment {self.k} uses {node.name}, computed in another segment, which is not a tensor")

    def copy(self, nodes: Sequence[fx.Node], state: Sequence[fx.Node]) -> tuple[bool, list[StateUse]]:
        """Copy ``nodes`` in; whether one depends on the training mode, and the ops that read ``state``."""
        mode_dependent = False
        position = {node: i for i, node in enumerate(state)}
        uses: list[StateUse] = []
        for node in nodes:
            self.env[node] = self.g.node_copy(node, self.lookup)
            mode_dependent = mode_dependent or depends_on_the_mode(node)
            read = tuple(position[a] for a in node.all_input_nodes if a in position)
            if read:
                uses.append(StateUse(self.env[node].name, read))
        return mode_dependent, uses


def _build(
    k: int, mine: list[fx.Node], *, incoming: list[fx.Node], outgoing: list[fx.Node], program: _Program
) -> SegmentGraph:
    """The graph of segment ``k``: state placeholders, received placeholders, its nodes, and its outputs."""
    builder = _SegmentBuilder(k)
    consumed = {arg for n in mine for arg in n.all_input_nodes}
    used_state = [program.placeholders[name] for name in program.state_of if program.placeholders[name] in consumed]
    for node in used_state:
        builder.placeholder(node.name, node)
    builder.received = [builder.placeholder(f"in_{node.name}", node) for node in incoming]
    mode_dependent, uses = builder.copy(mine, used_state)
    mutated = [(node, fqn) for node, fqn in program.mutations.items() if node in builder.env and node in mine]
    values = [builder.lookup(v) for v in outgoing] + [builder.env[node] for node, _ in mutated]
    builder.g.output(tuple(values))
    builder.g.eliminate_dead_code()
    return SegmentGraph(
        module=fx.GraphModule(program.gm, builder.g, class_name=f"Segment{k}"),
        state=tuple(program.state_of[node.name] for node in used_state),
        receives=len(incoming),
        emits=len(outgoing),
        mutated=tuple(fqn for _, fqn in mutated),
        mode_dependent=mode_dependent,
        uses=tuple(uses),
    )
