"""Path-keyed tensor-parallel plans: parameter or module names of the unsplit model (``*`` for any one component)
to a style, given as a mapping or read from a Hugging Face model's own ``tp_plan``."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, get_args

from torch import nn

from stagewise.errors import StagewiseError
from stagewise.partition import Layer
from stagewise.pipeline.config import TensorParallelPaths, TensorParallelStyle

if TYPE_CHECKING:
    from torch.distributed.tensor.parallel import ParallelStyle

log = logging.getLogger(__name__)

Split = Literal["colwise", "rowwise", "replicate"]
"""What a style does to a parameter: split by the output features, by the input features, or leave it whole."""

_SPLITS: dict[str, Split] = {
    "colwise": "colwise", "colwise_rep": "colwise", "colwise_gather_output": "colwise", "embedding_colwise": "colwise",
    "rowwise": "rowwise", "rowwise_rep": "rowwise", "rowwise_split_input": "rowwise", "embedding_rowwise": "rowwise",
    "replicate": "replicate", "replicated_with_grad_allreduce": "replicate",
}  # fmt: skip


class TensorPlanError(StagewiseError, ValueError):
    """A path-keyed tensor-parallel plan that cannot split the model: a key matching nothing, a style stagewise
    does not take, a dimension ``tp`` does not divide, tied copies split unalike; the message says which and why."""


def split_of(style: TensorParallelStyle) -> Split:
    """The split ``style`` makes of a parameter (see :data:`~stagewise.pipeline.config.TensorParallelStyle`)."""
    return _SPLITS[style]


def _matches(key: list[str], name: list[str]) -> bool:
    return len(key) == len(name) and all(k in ("*", n) for k, n in zip(key, name, strict=True))


@dataclass(frozen=True)
class PathPlan:
    """A plan keyed by path, checked: each key names a module, whose own parameters take its style, or a
    parameter, which takes its style before its module's."""

    styles: Mapping[str, TensorParallelStyle]
    """Key (dotted path, ``*`` for any one component) -> style."""
    source: str
    """Where the plan came from, for messages: ``PipelineOptions.tensor_parallel`` or the model's ``tp_plan``."""
    strict: bool = True
    """Refuse a key that names nothing in the model (a user's plan); a model's own plan may name modules some
    configurations lack."""

    def style_of(self, name: str) -> TensorParallelStyle | None:
        """The style of the parameter ``name`` (the unsplit model's): that of a key naming it, else of one naming
        its module; None where no key names either. Two keys that name it alike with different styles are
        refused."""
        parts = name.split(".")
        for target in (parts, parts[:-1]):
            found = {key: style for key, style in self.styles.items() if _matches(key.split("."), target)}
            if len(set(found.values())) > 1:
                raise TensorPlanError(
                    f"{self.source} gives {name} two styles, {found}; keep one of those keys, or make their styles "
                    "agree"
                )
            if found:
                return next(iter(found.values()))
        return None

    def check_names(self, names: Iterable[str]) -> None:
        """Refuse (where :attr:`strict`) a key that names no parameter nor module among the model's parameters
        ``names``."""
        split = [name.split(".") for name in names]
        paths = {tuple(parts[:end]) for parts in split for end in range(1, len(parts) + 1)}
        unmatched = [key for key in self.styles if not any(_matches(key.split("."), list(p)) for p in paths)]
        if not unmatched:
            return
        if not self.strict:
            log.info("%s names nothing in this model at %s; those keys are left out", self.source, unmatched)
            return
        sample = sorted(".".join(parts) for parts in split)[:4]
        raise TensorPlanError(
            f"{self.source} key {unmatched[0]!r} names no parameter or module of the model (whose parameters are "
            f"named like {sample}); write paths of the unsplit model, with '*' for any one component"
        )


def path_plan(given: TensorParallelPaths | Literal["model"], model: nn.Module) -> PathPlan:
    """The :class:`PathPlan` of ``PipelineOptions.tensor_parallel``: the mapping given, or for "model" the
    Hugging Face ``model``'s own plan (see :func:`model_plan`)."""
    if given != "model":
        assert not isinstance(given, str)  # narrowed: PipelineOptions accepts no other string
        return PathPlan(dict(given), "PipelineOptions.tensor_parallel")
    return PathPlan(model_plan(model), f"{_hf_model(model).__class__.__name__}'s tp_plan", strict=False)


def _hf_model(model: nn.Module) -> nn.Module:
    """The model a captured chain was captured from, or ``model`` itself."""
    source = getattr(model, "source", None)
    held = getattr(source, "model", None)
    return held if isinstance(held, nn.Module) else model


def model_plan(model: nn.Module) -> dict[str, TensorParallelStyle]:
    """A Hugging Face model's own tensor-parallel plan, under the unsplit model's names, as transformers builds
    it: the head class's ``_tp_plan`` (``{"lm_head": "colwise_gather_output"}``), and its config's
    ``base_model_tp_plan`` under the base model's attribute (``base_model_prefix``: ``model.layers.*...``). Where
    the model instance holds the plan transformers resolved (``model._tp_plan``, which adds the input embedding's
    ``embedding_rowwise``), that one. ``model`` may be the captured chain of such a model.

    Raises:
        TensorPlanError: a model without a plan (GPT-2's config has none), or one naming a style stagewise does
            not take.
    """
    source = _hf_model(model)
    resolved = getattr(source, "_tp_plan", None)
    plan: dict[str, str] = dict(resolved) if isinstance(resolved, Mapping) else {}
    if not plan:
        head = getattr(type(source), "_tp_plan", None)
        plan.update(head if isinstance(head, Mapping) else {})
        base = getattr(getattr(source, "config", None), "base_model_tp_plan", None) or {}
        prefix = getattr(source, "base_model_prefix", "")
        under = f"{prefix}." if prefix and isinstance(getattr(source, prefix, None), nn.Module) else ""
        plan.update({f"{under}{key}": style for key, style in base.items()})
    name = type(source).__name__
    if not plan:
        raise TensorPlanError(
            f"PipelineOptions.tensor_parallel='model', but {name} has no tensor-parallel plan (its config's "
            "base_model_tp_plan is empty); pass a mapping of its module paths to styles, e.g. "
            "{'transformer.h.*.mlp.c_fc': 'colwise', 'transformer.h.*.mlp.c_proj': 'rowwise'}"
        )
    accepted = get_args(TensorParallelStyle)
    for key, style in plan.items():
        if style not in accepted:
            raise TensorPlanError(
                f"{name}'s tp_plan maps {key!r} to {style!r}, which stagewise does not take; pass "
                f"PipelineOptions(tensor_parallel=mapping) with that key mapped to one of {', '.join(accepted)}"
            )
    return {str(key): style for key, style in plan.items()}  # type: ignore[misc]


def parameter_names(layers: Iterable[Layer]) -> list[str]:
    """Every name of every parameter of ``layers`` (a tied one under each), as the unsplit model names them."""
    return [
        layer.qualify(name) for layer in layers for name, _ in layer.module.named_parameters(remove_duplicate=False)
    ]


def module_styles(plan: PathPlan, layer: Layer) -> dict[str, ParallelStyle]:
    """What ``parallelize_module`` takes for ``layer`` (a module, not a captured graph) under ``plan``: each of
    its ``nn.Linear`` and ``nn.Embedding`` submodules that ``plan`` names (by the module's path, or its weight's)
    mapped to torch's ``ColwiseParallel`` or ``RowwiseParallel``, their outputs whole where a layer may end on
    them (a "colwise" module's output stays split for a "rowwise" one to take, as in a Megatron MLP). Refuses a
    style on another kind of module: use a mapping on a captured model, or a function plan."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    out: dict[str, ParallelStyle] = {}
    for path, sub in layer.module.named_modules():
        if not any(True for _ in sub.parameters(recurse=False)):
            continue
        name = layer.qualify(f"{path}.weight" if path else "weight")
        style = plan.style_of(name)
        if style is None or split_of(style) == "replicate":
            continue
        if not isinstance(sub, nn.Linear | nn.Embedding):
            raise TensorPlanError(
                f"{plan.source} splits {name.removesuffix('.weight')}, a {type(sub).__name__}: on modules that are "
                "not captured, a mapping splits nn.Linear and nn.Embedding only; capture the model "
                "(stagewise.partition.capture) or pass a function plan"
            )
        embedding = isinstance(sub, nn.Embedding)
        if split_of(style) == "colwise":
            whole = embedding or style != "colwise"
            out[path] = ColwiseParallel(output_layouts=Replicate()) if whole else ColwiseParallel()
        else:
            whole_input = embedding or style in ("rowwise_rep", "rowwise_split_input")
            out[path] = RowwiseParallel(input_layouts=Replicate()) if whole_input else RowwiseParallel()
    return out
