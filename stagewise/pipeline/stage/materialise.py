"""Materialise layers built on the meta device: allocate them on a device and initialise layer i from (seed, i)."""

from __future__ import annotations

from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from stagewise.partition import CapturedChain, layers_of, shared_parameters
from stagewise.partition.layers import SharedParameter
from stagewise.pipeline.config import Initialiser
from stagewise.pipeline.stage.retie import retie

_SEED_STRIDE = 1_000_003  # a prime: seeds (seed, layer) apart for any realistic layer count


@dataclass(frozen=True)
class Materialising:
    """Where and how layers on the meta device become real."""

    device: torch.device
    seed: int
    """Layer i is initialised from ``(seed, i)``."""
    init: Initialiser | None
    """The initialiser (see :func:`initialise`); None: each module's ``reset_parameters``."""


def layer_seed(seed: int, index: int) -> int:
    """The random seed that initialises layer ``index``: it depends on nothing else."""
    return seed * _SEED_STRIDE + index


def initialiser_of(model: nn.Module, init: Initialiser | None = None) -> Initialiser | None:
    """``init``, or else the model's own initialiser: a Hugging Face model's ``_init_weights`` (for a captured
    chain, that of the model it was captured from); None when it has none (each module's ``reset_parameters``)."""
    if init is not None:
        if not callable(init):
            raise TypeError(f"init must be a callable taking one module, got {type(init).__name__}")
        return init
    source = model.source.model if isinstance(model, CapturedChain) else model
    own = getattr(source, "_init_weights", None)
    if callable(own) and hasattr(source, "config"):
        return own  # type: ignore[no-any-return]
    return None


def _unset(tensor: torch.Tensor) -> None:
    """Fill a freshly allocated tensor with what no initialiser writes: NaN, or an integer type's least value."""
    if tensor.is_floating_point() or tensor.is_complex():
        tensor.fill_(float("nan"))
    elif tensor.dtype != torch.bool:
        tensor.fill_(torch.iinfo(tensor.dtype).min)


def _still_unset(tensor: torch.Tensor) -> bool:
    if tensor.is_floating_point() or tensor.is_complex():
        return bool(torch.isnan(tensor).any())
    if tensor.dtype == torch.bool or tensor.numel() == 0:
        return False
    return bool((tensor == torch.iinfo(tensor.dtype).min).any())


def initialise(
    module: nn.Module,
    seed: int,
    *,
    only: set[int] | None = None,
    init: Initialiser | None = None,
    given: Collection[str] = (),
    fresh: Collection[int] | None = None,
) -> None:
    """Give a freshly materialised module its initial values, drawn from ``seed`` alone.

    With ``init`` (see :data:`Initialiser`), it is called for every submodule,
    children before their parents (as ``nn.Module.apply`` does, so a parent
    may override what its children set), and each module's tensors are then
    marked ``_is_hf_initialized`` as Hugging Face's initialiser marks them (a
    tied tensor keeps its first value); without, every submodule that defines
    ``reset_parameters`` runs it, in module order. Both run under a generator
    seeded with ``seed``; with ``only``, just for the submodules whose ``id``
    is in it. A tensor of those submodules that no initialiser wrote (it still
    holds the NaN it was filled with) is refused by name, never left holding
    garbage; the names in ``given`` are exempt (tied parameters, which take
    the value of their first use), and ``init`` draws no random numbers for
    them, so a rank that holds only a later use draws what the others do. With ``fresh`` (ids of tensors), only those
    were just allocated: the others already hold their values.
    """
    chosen = [sub for sub in module.modules() if only is None or id(sub) in only]
    exempt = {id(t) for name, t in module.named_parameters(remove_duplicate=False) if name in given}
    held = {id(t) for sub in chosen for t in (*sub.parameters(recurse=False), *sub.buffers(recurse=False))}
    mine = [
        (name, t)
        for name, t in (*module.named_parameters(), *module.named_buffers())
        if id(t) in held and (fresh is None or id(t) in fresh)
    ]
    with torch.no_grad():
        for _, tensor in mine:
            _unset(tensor)
            if init is not None and id(tensor) in exempt:  # it takes its first use's value: draw nothing for it
                tensor._is_hf_initialized = True  # type: ignore[attr-defined]
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(seed)
        if init is not None:
            wanted = {id(sub) for sub in chosen}
            for sub in _children_first(module):
                if id(sub) in wanted:
                    init(sub)
                    _mark_initialised(sub)
        else:
            for sub in chosen:
                reset = getattr(sub, "reset_parameters", None)
                if callable(reset):
                    reset()
    missed = [name for name, tensor in mine if id(tensor) not in exempt and _still_unset(tensor)]
    if missed:
        how = "the model's initialiser (init)" if init is not None else "a reset_parameters() method"
        raise TypeError(
            f"{type(module).__name__} was built on the meta device, but {how} gives {missed[:5]} no value; add "
            "reset_parameters() to the modules that own them, pass init= (a callable that initialises one module's "
            "own tensors), or build the model with real weights"
        )


def _children_first(module: nn.Module) -> Iterator[nn.Module]:
    """``module``'s submodules, each after its children, siblings in order (as ``nn.Module.apply`` visits them);
    a module held twice comes once."""
    seen: set[int] = set()

    def visit(here: nn.Module) -> Iterator[nn.Module]:
        for child in here.children():
            yield from visit(child)
        if id(here) not in seen:
            seen.add(id(here))
            yield here

    return visit(module)


def _mark_initialised(module: nn.Module) -> None:
    """Mark ``module``'s own tensors as initialised, as a Hugging Face model's initialiser does, so that a
    module sharing one (a head tied to an embedding) leaves the value of the first to set it."""
    for tensor in (*module.parameters(recurse=False), *module.buffers(recurse=False)):
        tensor._is_hf_initialized = True  # type: ignore[attr-defined]


def _is_meta_here(module: nn.Module) -> bool:
    return any(t.is_meta for t in (*module.parameters(recurse=False), *module.buffers(recurse=False)))


def _with_ancestors(root: nn.Module, modules: Sequence[nn.Module]) -> list[nn.Module]:
    """``modules`` and every submodule of ``root`` that contains one of them, in ``root.modules()`` order."""
    wanted = {id(m) for m in modules}
    return [sub for sub in root.modules() if any(id(m) in wanted for m in sub.modules())]


def _meta_parts(layer: nn.Module) -> Iterator[nn.Module]:
    return (sub for sub in layer.modules() if _is_meta_here(sub))


def _allocate(module: nn.Module, device: torch.device) -> list[torch.Tensor]:
    """Give ``module``'s own meta tensors uninitialised memory on ``device``, and return them; its real ones (a
    tied weight an earlier layer made real) stay as they are."""
    made: list[torch.Tensor] = []
    for name, param in list(module.named_parameters(recurse=False)):
        if param.is_meta:
            made.append(nn.Parameter(torch.empty_like(param, device=device), param.requires_grad))
            setattr(module, name, made[-1])
    for name, buffer in list(module.named_buffers(recurse=False)):
        if buffer.is_meta:
            made.append(torch.empty_like(buffer, device=device))
            setattr(module, name, made[-1])
    return made


def _aliases(layer: nn.Module) -> list[list[str]]:
    """The names of each parameter that ``layer`` holds under several (a head tied to an embedding)."""
    names: dict[int, list[str]] = {}
    for name, param in layer.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return [group for group in names.values() if len(group) > 1]


def _tie_again(layer: nn.Module, aliases: Sequence[Sequence[str]]) -> None:
    """Make each group of names in ``aliases`` one parameter again, the first name's (allocating modules one by
    one gave each its own)."""
    for first, *others in aliases:
        param = layer.get_parameter(first)
        for name in others:
            path, _, leaf = name.rpartition(".")
            setattr(layer.get_submodule(path) if path else layer, leaf, param)


def _hand_back(layer: nn.Module, allocated: Sequence[nn.Module]) -> dict[int, nn.Module]:
    """Give the model's modules that a captured segment's modules stand in for (the segment reads only part of
    them) the tensors just allocated for them, so that the model's initialiser, which knows its own modules'
    classes, writes them; returns the stand-ins' ids and the modules they stand for."""
    owner_of = getattr(layer, "owner_of", None)
    owners: dict[int, nn.Module] = {}
    if not callable(owner_of):
        return owners
    for sub in allocated:
        owner = owner_of(sub)
        if isinstance(owner, nn.Module):
            for name, tensor in (*sub.named_parameters(recurse=False), *sub.named_buffers(recurse=False)):
                setattr(owner, name, tensor)
            owners[id(sub)] = owner
    return owners


def _through(init: Initialiser | None, owners: dict[int, nn.Module]) -> Initialiser | None:
    """``init`` applied to the module a stand-in stands for (see :func:`_hand_back`), to others as they are."""
    if init is None or not owners:
        return init
    chosen = init
    return lambda module: chosen(owners.get(id(module), module))


def materialise(
    layer: nn.Module,
    index: int,
    device: torch.device,
    seed: int,
    *,
    init: Initialiser | None = None,
    shared: Sequence[SharedParameter] = (),
) -> nn.Module:
    """``layer`` on ``device``: its meta parts are allocated there and initialised from ``(seed, index)``.

    Only the submodules that hold meta tensors are allocated and initialised
    (see :func:`initialise`, which ``init`` is passed to): a module that an
    earlier layer shares with this one (a segment of a captured model reading
    a tied embedding) keeps the values it already has. A parameter that
    ``shared`` lists as a later use of a tie may stay unset: it takes its
    first use's value when the layers are tied again.
    """
    meta = list(_meta_parts(layer))
    if meta:
        aliases = _aliases(layer)
        fresh = {id(t) for sub in meta for t in _allocate(sub, device)}
        _tie_again(layer, aliases)
        layer.to(device)
        owners = _hand_back(layer, meta) if init is not None else {}
        only = {id(sub) for sub in _with_ancestors(layer, meta)}
        given = {tie.attributes[k] for tie in shared for k, i in enumerate(tie.indices) if i == index and k > 0}
        initialise(layer, layer_seed(seed, index), only=only, init=_through(init, owners), given=given, fresh=fresh)
    else:
        layer.to(device)
    return layer


def materialise_model(
    model: nn.Module, *, device: torch.device | str = "cpu", seed: int = 0, init: Initialiser | None = None
) -> nn.Module:
    """Materialise every layer of an unsplit chain as :class:`Pipeline` does for its own stages.

    A model built on the meta device gets, layer by layer, the same initial
    values that the stages of a pipeline with the same ``seed`` and ``init``
    get, whatever the split: the single-process reference of the same
    training. ``init`` defaults to the model's own initialiser (see
    :func:`initialiser_of`). Tied parameters are tied again, with the value of
    the first layer that uses them.
    """
    layers = layers_of(model)
    shared = shared_parameters(layers)  # before materialising, which unties them
    chosen = initialiser_of(model, init)
    for index, layer in enumerate(layers):
        materialise(layer.module, index, torch.device(device), seed, init=chosen, shared=shared)
    retie(layers, shared, set(range(len(layers))))
    return model
