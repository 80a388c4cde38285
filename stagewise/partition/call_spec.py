"""How a captured model is called: its inputs by name and shape (free batch and length), and the output it returns."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from stagewise.partition.graph import CaptureError
from stagewise.partition.layers import Payload

if TYPE_CHECKING:
    from torch.export import ExportedProgram
    from torch.utils._pytree import TreeSpec

Inputs = Payload | Mapping[str, torch.Tensor]
"""A model's inputs for one batch: a tensor, a tuple of tensors (positional), or tensors by keyword."""


@dataclass(frozen=True)
class Extent:
    """The sizes one dimension of an input may take: ``low`` to ``high`` (inclusive; ``high`` None for no bound)."""

    low: int
    high: int | None
    symbolic: bool
    """Whether the size was left free at capture (batch, length); a fixed dimension has ``low == high``."""

    def admits(self, size: int) -> bool:
        return size >= self.low and (self.high is None or size <= self.high)

    def __str__(self) -> str:
        if not self.symbolic:
            return str(self.low)
        return f"{self.low} to {self.high}" if self.high is not None else f"{self.low} or more"


@dataclass(frozen=True)
class InputSpec:
    """One input of a captured model."""

    name: str
    """Its keyword (``input_ids``), or ``input k`` for the k-th positional input."""
    dtype: torch.dtype
    extents: tuple[Extent, ...]
    """The sizes each dimension may take."""


@dataclass(frozen=True)
class CallSpec:
    """How a captured model takes its inputs: positionally or by keyword, each with the sizes it may have.

    :meth:`positional` turns a batch as the model takes it (``{"input_ids": ..., "attention_mask": ...}`` for a
    model called by keyword) into the tensors its first segment takes, in order, and refuses one the captured
    graph cannot run, saying which input and dimension and what it allows.
    """

    model: str
    """The captured model's class name, for messages."""
    inputs: tuple[InputSpec, ...]
    keywords: bool
    """Whether the model was captured with keyword inputs (so it takes a mapping)."""
    length_note: str = ""
    """Where a length dimension's bound comes from, to say in a refusal (e.g. its config's max_position_embeddings)."""

    def positional(self, inputs: Inputs) -> Payload:
        """``inputs`` as the tensor or tuple of tensors the captured graph takes, checked against the capture."""
        tensors = self._ordered(inputs)
        for spec, tensor in zip(self.inputs, tensors, strict=True):
            self._check(spec, tensor)
        return tensors if len(tensors) > 1 else tensors[0]

    def _ordered(self, inputs: Inputs) -> tuple[torch.Tensor, ...]:
        names = [s.name for s in self.inputs]
        if isinstance(inputs, Mapping):
            if not self.keywords:
                raise TypeError(
                    f"{self.model} was captured with positional inputs, got keywords {sorted(inputs)}; pass a tensor "
                    "or a tuple of tensors, or capture it with an example given by keyword"
                )
            missing, extra = [n for n in names if n not in inputs], sorted(set(inputs) - set(names))
            if missing or extra:
                raise ValueError(
                    f"{self.model} was captured with the inputs {names}, got {sorted(inputs)} (missing {missing}, "
                    f"unknown {extra}); pass exactly the keywords of the capture's example"
                )
            values = [inputs[n] for n in names]
        else:
            values = list(inputs) if isinstance(inputs, (tuple, list)) else [inputs]
            if len(values) != len(names):
                raise ValueError(
                    f"{self.model} was captured with {len(names)} inputs ({names}), got {len(values)}; pass the same "
                    "inputs as the capture's example"
                )
        bad = [n for n, v in zip(names, values, strict=True) if not isinstance(v, torch.Tensor)]
        if bad:
            raise TypeError(f"the inputs {bad} of {self.model} must be tensors")
        return tuple(values)

    def _check(self, spec: InputSpec, tensor: torch.Tensor) -> None:
        if tensor.dim() != len(spec.extents):
            raise ValueError(
                f"{spec.name} of {self.model} has {tensor.dim()} dimensions (shape {tuple(tensor.shape)}), but it was "
                f"captured with {len(spec.extents)}"
            )
        for dim, (size, extent) in enumerate(zip(tensor.shape, spec.extents, strict=True)):
            if extent.admits(int(size)):
                continue
            if not extent.symbolic:
                fix = "capture the model with dynamic_length=True, or pass inputs of the captured size"
                if dim == 0:
                    fix = "the batch dimension is free: this is a bug, please report it"
            else:
                fix = f"the bound is {self.length_note}" if self.length_note and dim > 0 else "pass sizes in that range"
            raise ValueError(
                f"{spec.name} of {self.model} has size {size} in dimension {dim} (shape {tuple(tensor.shape)}), but "
                f"the captured graph runs sizes {extent} there; {fix}"
            )


def call_spec(
    ep: ExportedProgram, model: str, *, keywords: bool, names: Sequence[str], length_note: str = ""
) -> CallSpec:
    """The call spec of the exported program ``ep`` whose user inputs are ``names`` in order."""
    from torch.export.graph_signature import InputKind

    nodes = {n.name: n for n in ep.graph.nodes if n.op == "placeholder"}
    placeholders = [s.arg.name for s in ep.graph_signature.input_specs if s.kind == InputKind.USER_INPUT]
    specs = []
    for name, placeholder in zip(names, placeholders, strict=True):
        val = nodes[placeholder].meta["val"]
        specs.append(InputSpec(name, val.dtype, tuple(_extent(ep, size) for size in val.shape)))
    return CallSpec(model, tuple(specs), keywords, length_note)


def _extent(ep: ExportedProgram, size: int | torch.SymInt) -> Extent:
    if isinstance(size, int):
        return Extent(size, size, symbolic=False)
    ranges = ep.range_constraints.get(size.node.expr)
    if ranges is None:
        return Extent(1, None, symbolic=True)
    low, high = float(ranges.lower), float(ranges.upper)
    return Extent(int(low) if math.isfinite(low) else 0, int(high) if math.isfinite(high) else None, symbolic=True)


@dataclass(frozen=True)
class OutputChoice:
    """Which of a captured model's flat outputs its chain returns, and whether as a lone tensor."""

    indices: tuple[int, ...]
    """Positions among the model's flat outputs (all of them for a tensor or a tuple of tensors)."""
    bare: bool
    """Whether the chain returns a lone tensor rather than a tuple."""


def chosen_output(spec: TreeSpec | None, model: str, output: str) -> OutputChoice:
    """What the chain of a model with output structure ``spec`` returns: the model's tensor or tuple of tensors,
    or the entry ``output`` of a mapping, ModelOutput or dataclass it returns."""
    if spec is None or spec.is_leaf():
        return OutputChoice((0,), bare=True)
    children = spec.children()
    if spec.type in (tuple, list):
        if all(c.is_leaf() for c in children):
            return OutputChoice(tuple(range(len(children))), bare=False)
        raise CaptureError(
            f"{model} must return a tensor, a tuple of tensors or a mapping of them; its output is {spec}"
        )
    keys = [str(k) for k in spec.context] if isinstance(spec.context, (list, tuple)) else []
    if len(keys) != len(children):
        raise CaptureError(f"{model} returns a {spec.type.__name__}, whose entries stagewise cannot name: {spec}")
    if output not in keys:
        raise CaptureError(
            f"{model} returns a {spec.type.__name__} with the entries {keys}, none named {output!r}; pass "
            "output=<the entry its loss reads> to capture()"
        )
    position = keys.index(output)
    if not children[position].is_leaf():
        raise CaptureError(f"the entry {output!r} of {model}'s output is not a tensor; choose one that is")
    start = sum(c.num_leaves for c in children[:position])
    return OutputChoice((start,), bare=True)


def positional_inputs(model: object, inputs: Inputs) -> Payload:
    """``inputs`` as the first layer of ``model`` takes them: a captured model's (see :class:`CallSpec`) by
    keyword or position, checked against its capture; a chain's as they are."""
    call = getattr(model, "call", None)
    return as_positional(call if isinstance(call, CallSpec) else type(model).__name__, inputs)


def as_positional(call: CallSpec | str, inputs: Inputs) -> Payload:
    """``inputs`` as the captured model with the call spec ``call`` takes them, or, for a chain (``call`` is
    then its class name), as they are; a chain refuses keywords."""
    if isinstance(call, CallSpec):
        return call.positional(inputs)
    if isinstance(inputs, Mapping):
        raise TypeError(
            f"{call} takes a tensor or a tuple of tensors, got keywords {sorted(inputs)}; a model called by "
            "keyword runs once capture() has taken it with an example given by keyword"
        )
    return inputs
