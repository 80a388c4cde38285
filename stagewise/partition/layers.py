"""layers_of(): a chain's ordered, named layers, the Payload that flows between them, and the parameters they share."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TypeAlias

import torch
from torch import nn

Payload: TypeAlias = torch.Tensor | tuple[torch.Tensor, ...]
"""What flows between layers: a tensor or a tuple of tensors."""

CHAIN_ATTRIBUTE = "stagewise_chain"
"""The attribute by which a module declares its chain (see :func:`layers_of`)."""

LAYERS_METHOD = "stagewise_layers"
"""A method that returns a module's layers itself (see :class:`stagewise.partition.CapturedChain`)."""

_CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)


@dataclass(frozen=True)
class Layer:
    """One layer of a chain: its dotted path in the model and the module itself."""

    name: str
    """Path of the module in the unsplit model (``blocks.3``); parameter ``p`` of it is ``name.p``."""
    module: nn.Module
    prefix: str | None = None
    """What its parameter names start with in the unsplit model: ``name`` when None; ``""`` for a
    layer whose parameters carry their full names (a segment of a captured model)."""

    def qualify(self, key: str) -> str:
        """The unsplit model's name of this layer's parameter, buffer or state key ``key``."""
        prefix = self.name if self.prefix is None else self.prefix
        return f"{prefix}.{key}" if prefix else key


@dataclass(frozen=True)
class SharedParameter:
    """A parameter that more than one layer uses (tied weights)."""

    layers: tuple[str, ...]
    """The names of the layers that hold it, in chain order."""
    names: tuple[str, ...]
    """Its full name in each of those layers."""
    indices: tuple[int, ...]
    """The chain index of each of those layers."""
    attributes: tuple[str, ...]
    """Its dotted name inside each of those layers (``weight``, ``tokens.weight``)."""
    numel: int = 0
    """Its number of elements."""
    nbytes: int = 0
    """Its bytes."""


def _entries(container: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """A container's children in order; a module it holds under two names comes at both (``named_children``
    lists it once, but ``nn.Sequential`` runs it twice)."""
    for name, module in container.named_modules(remove_duplicate=False):
        if name and "." not in name:
            yield name, module


def _children(prefix: str, container: nn.Module, flatten: bool) -> Iterator[Layer]:
    for key, child in _entries(container):
        name = f"{prefix}.{key}" if prefix else key
        if flatten and isinstance(child, _CONTAINERS):
            yield from _children(name, child, flatten)
        else:
            yield Layer(name, child)


def _declared(model: nn.Module, flatten: bool) -> Iterator[Layer]:
    chain = getattr(model, CHAIN_ATTRIBUTE)
    if isinstance(chain, str) or not all(isinstance(c, str) for c in chain):
        raise TypeError(
            f"{type(model).__name__}.{CHAIN_ATTRIBUTE} must be a sequence of submodule names, got {chain!r}"
        )
    for path in chain:
        try:
            sub = model.get_submodule(path)
        except AttributeError as err:
            raise TypeError(
                f"{type(model).__name__}.{CHAIN_ATTRIBUTE} names {path!r}, which is not a submodule: {err}"
            ) from err
        if isinstance(sub, _CONTAINERS):
            yield from _children(path, sub, flatten)
        else:
            yield Layer(path, sub)


def shared_parameters(layers: list[Layer]) -> list[SharedParameter]:
    """Parameters held by more than one layer, each listed once."""
    holders: dict[int, list[tuple[int, str]]] = {}
    sizes: dict[int, tuple[int, int]] = {}
    for index, layer in enumerate(layers):
        seen: set[int] = set()
        for pname, param in layer.module.named_parameters(remove_duplicate=False):
            if id(param) in seen:
                continue
            seen.add(id(param))
            holders.setdefault(id(param), []).append((index, pname))
            sizes[id(param)] = (param.numel(), param.numel() * param.element_size())
    return [
        SharedParameter(
            layers=tuple(layers[i].name for i, _ in held),
            names=tuple(layers[i].qualify(a) for i, a in held),
            indices=tuple(i for i, _ in held),
            attributes=tuple(a for _, a in held),
            numel=sizes[key][0],
            nbytes=sizes[key][1],
        )
        for key, held in holders.items()
        if len(held) > 1
    ]


def layers_of(model: nn.Module, *, flatten: bool = False) -> list[Layer]:
    """The layers of ``model`` in execution order, named by their path in the model.

    A model is a chain when running it equals running its layers one after
    another, each layer's output (a tensor or a tuple of tensors) passed as the
    single argument of the next, as in ``nn.Sequential``. Recognised chains:

    * ``nn.Sequential``, ``nn.ModuleList`` and ``nn.ModuleDict``: their
      children, in order. Nested containers stay one layer each unless
      ``flatten=True``, which expands them recursively.
    * Any module with a ``stagewise_chain`` attribute: a sequence of submodule
      paths in execution order, e.g. ``("embed", "blocks", "norm", "head")``.
      A path that names a container contributes that container's children
      (``blocks.0``, ``blocks.1``, ...). Every parameter of the model must
      belong to one of the listed layers.
    * Any module with a ``stagewise_layers()`` method, which returns its
      layers itself: a :class:`~stagewise.partition.CapturedChain`, the chain
      :func:`~stagewise.partition.capture` makes of a model that is not one.

    Layers may share parameters (tied weights, such as an embedding and an
    LM head): :func:`shared_parameters` lists them, and
    :class:`stagewise.Pipeline` keeps one copy per stage that uses them, with
    their gradients summed.

    Raises:
        TypeError: the model is not a chain; the message says how to make it one.
        ValueError: the model has no layers, lists a layer twice, or runs a module with parameters or
            buffers at two places.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"layers_of expects an nn.Module, got {type(model).__name__}")
    layers = _found_layers(model, flatten)
    _check_chain(model, layers)
    return layers


def _found_layers(model: nn.Module, flatten: bool) -> list[Layer]:
    """The layers the model provides, declares or contains, in that order of precedence; refused when it is
    none of those chains."""
    provided = getattr(model, LAYERS_METHOD, None)
    if callable(provided):
        return list(provided())
    if hasattr(model, CHAIN_ATTRIBUTE):
        return list(_declared(model, flatten))
    if isinstance(model, _CONTAINERS):
        return list(_children("", model, flatten))
    raise TypeError(
        f"{type(model).__name__} is not a chain of layers: stagewise splits nn.Sequential, nn.ModuleList, "
        f"nn.ModuleDict, or a module that lists its layers in execution order in a "
        f"'{CHAIN_ATTRIBUTE}' attribute (e.g. {CHAIN_ATTRIBUTE} = ('embed', 'blocks', 'norm', 'head')). "
        f"For a model whose forward is not a chain, stagewise.partition.capture(model, example) captures it "
        f"with torch.export and cuts it at its repeated blocks into a chain."
    )


def _check_chain(model: nn.Module, layers: list[Layer]) -> None:
    """Refuse an empty chain, a layer listed twice, a module with state at two places, and (for a declared chain)
    parameters that no layer holds."""
    kind = type(model).__name__
    if not layers:
        raise ValueError(f"{kind} has no layers to split; it is an empty chain")
    names = [layer.name for layer in layers]
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise ValueError(f"{kind} lists these layers more than once: {dup}; each layer may appear once")
    _check_reused(kind, layers)
    if hasattr(model, CHAIN_ATTRIBUTE):
        covered = {id(p) for layer in layers for p in layer.module.parameters()}
        stray = [n for n, p in model.named_parameters() if id(p) not in covered]
        if stray:
            raise ValueError(
                f"{kind}.{CHAIN_ATTRIBUTE} leaves out parameters {stray[:5]}"
                f"{' ...' if len(stray) > 5 else ''}; list every module that owns parameters"
            )


def _check_reused(kind: str, layers: list[Layer]) -> None:
    """Refuse a module with parameters or buffers at two places of the chain; a stateless one (an activation)
    may recur."""
    first: dict[int, Layer] = {}
    for layer in layers:
        earlier = first.setdefault(id(layer.module), layer)
        stateful = any(True for _ in layer.module.parameters()) or any(True for _ in layer.module.buffers())
        if earlier is not layer and stateful:
            raise ValueError(
                f"{kind} runs the same {type(layer.module).__name__} as layers {earlier.name!r} and {layer.name!r}; "
                "a layer with parameters or buffers may appear once in a chain, since each stage holds its own "
                f"layers. To share its weights, put a module of its own at {layer.name!r} and tie its parameters to "
                f"{earlier.name!r}'s (e.g. second.weight = first.weight): stagewise keeps tied parameters equal "
                "across stages"
            )
