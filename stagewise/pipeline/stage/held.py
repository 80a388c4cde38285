"""HeldStages: the parameters and state of one rank's stages, named as in the unsplit model."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TypeVar

import torch
from torch import nn

from stagewise.partition.layers import SharedParameter
from stagewise.pipeline.stage.module import StageModule

Self = TypeVar("Self", bound="HeldStages")


@dataclass(frozen=True)
class ModelNames:
    """The unsplit model's names, whichever rank holds what they name: what a checkpoint maps its tensors by."""

    keys: frozenset[str]
    """Every key of the unsplit model's ``state_dict``."""
    tied: tuple[SharedParameter, ...]
    """The parameters its layers share (a tied embedding and head), each with every name it has."""


class HeldStages:
    """What one rank holds of the model: its stages (in :attr:`stages`), their parameters and their state.

    The base of :class:`~stagewise.Pipeline`: the model-like half of its interface (``parameters``,
    ``state_dict``, ``train``, ``eval``), as an optimizer or a checkpoint sees it.
    """

    stages: dict[int, StageModule]
    """This rank's stages by their number in the pipeline."""
    model_names: ModelNames
    """The unsplit model's names (its ``state_dict``'s keys, its tied parameters), for checkpoints."""

    def parameters(self) -> Iterator[nn.Parameter]:
        """This rank's parameters, each once (a tied parameter used by two of its stages too)."""
        for _, param in self.named_parameters():
            yield param

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """This rank's parameters, named as in the unsplit model; a tied one by its first name here."""
        seen: set[int] = set()
        for stage in self.stages.values():
            for name, param in stage.named_chain_parameters():
                if id(param) not in seen:
                    seen.add(id(param))
                    yield name, param

    def state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's parameters and buffers, named as in the unsplit model."""
        out: dict[str, torch.Tensor] = {}
        for stage in self.stages.values():
            out.update(stage.chain_state_dict())
        return out

    def train(self: Self, mode: bool = True) -> Self:
        """Put every stage of this rank in training mode (``mode=False``: evaluation), as ``nn.Module.train``."""
        for stage in self.stages.values():
            stage.train(mode)
        return self

    def eval(self: Self) -> Self:
        """Put every stage of this rank in evaluation mode."""
        return self.train(False)
