"""The loss a training run minimises: each model's ``loss_fn`` and how the pipeline reduces it over a batch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

from stagewise.models import GPTConfig, ModelConfig
from stagewise.models.gpt import IGNORE_INDEX
from stagewise.pipeline import LossFn, LossReduction
from stagewise.run.user_model import UserModel


@dataclass(frozen=True)
class Objective:
    """A model's ``loss_fn`` for one micro-batch, and the reduction that makes the micro-batches' losses the
    global batch's (:attr:`stagewise.pipeline.Loss.reduction`)."""

    loss_fn: LossFn
    reduction: LossReduction
    ignore_index: int = IGNORE_INDEX
    """The target no loss counts, for ``reduction="tokens"``."""


def objective(model: ModelConfig | UserModel) -> Objective:
    """A language model's loss (a GPT preset's, or the user's) is the mean over the valid target tokens of the
    global batch (Hugging Face's: a summed cross-entropy per micro-batch, divided by the global count); on unpadded
    text it is the mean over every position. The other presets average their loss over the samples."""
    if isinstance(model, (GPTConfig, UserModel)):
        return Objective(cast(LossFn, model.token_loss), "tokens")
    return Objective(cast(LossFn, model.loss), "mean")
