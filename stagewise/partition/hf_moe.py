"""Hugging Face mixture-of-experts models under capture: which experts implementation torch.export captures, and
the router outputs that the captured chain leaves out."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

from torch import nn

from stagewise.partition.graph import CaptureError

log = logging.getLogger(__name__)

CAPTURED_IMPLEMENTATIONS = ("grouped_mm", "batched_mm")
"""transformers' experts implementations that torch.export captures: fixed shapes, every expert's weights in the
graph, the routing as tensors (sorted token groups with offsets, or one gathered weight per token)."""


def _experts_implementation(module: nn.Module) -> str | None:
    """The experts implementation an experts module of transformers runs (its config's choice), or None for a
    module that is no such experts module."""
    if not hasattr(module, "_is_expert_parallel"):  # set on every experts class that chooses an implementation
        return None
    choice = getattr(getattr(module, "config", None), "_experts_implementation", None)
    return choice if isinstance(choice, str) else None


def refuse_eager_experts(model: nn.Module) -> None:
    """Refuse a model whose experts run transformers' ``"eager"`` implementation, before torch.export tries it.

    That implementation loops in Python over the experts that received a token, so the graph would depend on how
    many did (a data-dependent count, which torch.export cannot guard on); the others
    (:data:`CAPTURED_IMPLEMENTATIONS`) are captured.

    Raises:
        CaptureError: naming the model's class, its first such experts module, and the fix.
    """
    eager = [name for name, m in model.named_modules() if _experts_implementation(m) == "eager"]
    if not eager:
        return
    first = model.get_submodule(eager[0])
    raise CaptureError(
        f"torch.export cannot capture {type(model).__name__}: its {len(eager)} experts modules "
        f"({type(first).__name__}, {eager[0]}, ...) run transformers' 'eager' experts implementation, a Python loop "
        "over the experts that received tokens, whose count depends on the data; build it with "
        "experts_implementation='grouped_mm' (or 'batched_mm') in its config or from_pretrained(), or call "
        "model.set_experts_implementation('grouped_mm') before capture()"
    )


@contextmanager
def router_logits_off(model: nn.Module) -> Iterator[None]:
    """A model whose Hugging Face style config asks for the router's logits (``output_router_logits``, which adds
    the load-balancing loss at the model's end) runs without them, and a warning says so once.

    The auxiliary loss is computed at the model's end from every layer's router logits; the chain returns the
    logits alone, so carrying every layer's router logits from stage to stage would cost communication for a value
    no loss reads. Training minimises the pipeline's ``loss_fn`` on the logits.
    """
    config = getattr(model, "config", None)
    if config is None or getattr(config, "output_router_logits", None) is not True:
        yield
        return
    coefficient = getattr(config, "router_aux_loss_coef", None)
    log.warning(
        "%s's config asks for the router's load-balancing loss (output_router_logits=True, router_aux_loss_coef=%s); "
        "the captured chain returns the logits only, so a pipeline trains its loss_fn without that loss (it needs "
        "every layer's router logits at the model's end); set output_router_logits=False to silence this",
        type(model).__name__,
        coefficient,
    )
    config.output_router_logits = False
    try:
        yield
    finally:
        config.output_router_logits = True
