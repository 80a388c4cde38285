"""Layers that share a parameter made to share it again, after materialising gave each its own copy."""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from stagewise.partition import Layer
from stagewise.partition.layers import SharedParameter


def holder(layers: Sequence[Layer], shared: SharedParameter, k: int) -> tuple[nn.Module, str]:
    """The module that holds the ``k``-th use of ``shared`` directly, and the attribute name there."""
    path, _, leaf = shared.attributes[k].rpartition(".")
    module = layers[shared.indices[k]].module
    return (module.get_submodule(path) if path else module), leaf


def retie(layers: Sequence[Layer], shared: Sequence[SharedParameter], held: set[int]) -> None:
    """Make the layers in ``held`` that share a parameter use one Parameter again: their first holder's.

    Materialising layers one by one from the meta device gives each its own
    tensor, which breaks ties; this restores them.
    """
    for tie in shared:
        mine = [k for k, i in enumerate(tie.indices) if i in held]
        if len(mine) < 2:
            continue
        module, leaf = holder(layers, tie, mine[0])
        param = getattr(module, leaf)
        for k in mine[1:]:
            other, name = holder(layers, tie, k)
            setattr(other, name, param)
