"""The user's own language model for a run: a Hugging Face folder (``hf:DIR``) or a factory (``MODULE:FACTORY``)."""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from stagewise.models import PRESETS, ModelConfig, preset
from stagewise.models.gpt import IGNORE_INDEX
from stagewise.partition import CapturedChain, capture

HF = "hf:"
"""The prefix of a model given as a local Hugging Face folder."""


@dataclass(frozen=True)
class UserModel:
    """A causal language model the user brings, trained on the run's text: token ids (``input_ids``) in, logits
    (or a ModelOutput or mapping with ``logits``) out, one per position, captured as it is (see
    :func:`stagewise.partition.capture`).

    ``hf:DIR`` is a local folder with a ``config.json`` (nothing is downloaded); the model is built from the
    config on the meta device, and starts from the folder's safetensors weights when it has some, read per
    stage. ``MODULE:FACTORY`` names a function that returns the model (built on the meta device by the run).
    """

    name: str
    """As given: ``hf:DIR`` or ``MODULE:FACTORY``."""

    @property
    def folder(self) -> Path | None:
        """The Hugging Face folder, for ``hf:DIR``."""
        return Path(self.name[len(HF) :]) if self.name.startswith(HF) else None

    def build(self, *, device: torch.device | str | None = "meta") -> nn.Module:
        """The model, on ``device`` (by default the meta device: no weights allocated)."""
        with torch.device(device if device is not None else "cpu"):
            model = self._hf() if self.folder is not None else factory_of(self.name)()
        if not isinstance(model, nn.Module):
            raise TypeError(f"{self.name} returned a {type(model).__name__}, not an nn.Module")
        return model.train()

    def _hf(self) -> nn.Module:
        try:
            import transformers
        except ImportError as err:
            raise ImportError(f"--model {self.name} needs transformers: pip install transformers") from err
        model: nn.Module = transformers.AutoModelForCausalLM.from_config(  # type: ignore[no-untyped-call]
            self.config, trust_remote_code=False
        )
        return model

    @property
    def config(self) -> Any:
        """The Hugging Face config (``hf:DIR``), for :func:`stagewise.checkpoint.export`; None for a factory."""
        folder = self.folder
        if folder is None:
            return None
        import transformers

        return transformers.AutoConfig.from_pretrained(folder, trust_remote_code=False, local_files_only=True)

    @property
    def weights(self) -> Path | None:
        """The folder's pretrained weights, when it holds safetensors files."""
        folder = self.folder
        return folder if folder is not None and any(folder.glob("*.safetensors")) else None

    def example(self, batch: int, seq_len: int | None = None, *, packed: bool = False) -> dict[str, torch.Tensor]:
        """A micro-batch of ``batch`` sequences of ``seq_len`` token ids (zeros); ``packed``: with each token's
        position in its document too (``position_ids``, here one document a row), as packed documents are given
        (see :mod:`stagewise.run.token_windows`)."""
        ids = torch.zeros(batch, seq_len or 2, dtype=torch.long)
        if not packed:
            return {"input_ids": ids}
        return {"input_ids": ids, "position_ids": torch.arange(ids.shape[1]).expand_as(ids).contiguous()}

    def chain(self, batch: int, seq_len: int, *, packed: bool = False) -> CapturedChain:
        """The model on the meta device, captured at ``seq_len`` (any length up to its limit runs); ``packed``:
        taking ``position_ids`` too, by which Hugging Face's attention keeps packed documents apart."""
        model = self.build(device="meta")
        limit = getattr(getattr(model, "config", None), "max_position_embeddings", None)
        if isinstance(limit, int) and seq_len > limit:
            raise ValueError(f"seq_len={seq_len} exceeds {self.name}'s longest sequence, {limit}")
        return capture(model, self.example(batch, seq_len, packed=packed))

    @property
    def vocab_size(self) -> int | None:
        """The tokens the model embeds: its config's ``vocab_size``, else its first embedding's rows; None where
        neither says."""
        model = self.build(device="meta")
        vocab = getattr(getattr(model, "config", None), "vocab_size", None)
        if isinstance(vocab, int):
            return vocab
        table = next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
        return table.num_embeddings if table is not None else None

    @staticmethod
    def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Cross-entropy of each position's logits against the next token (the run's targets are shifted)."""
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE_INDEX)

    @staticmethod
    def token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The same cross-entropy summed over the positions whose target is not padding, for a pipeline with
        ``Loss(reduction="tokens")``: the global batch's token mean, as Hugging Face computes it."""
        return F.cross_entropy(
            logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
        )


def factory_of(name: str) -> Any:
    """The function ``MODULE:FACTORY`` names, imported (the command line's model: trusted as the user's code)."""
    module_name, _, factory_name = name.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"--model {name}: cannot import {module_name!r} ({err}); is it on PYTHONPATH?") from err
    factory = getattr(module, factory_name, None)
    if not callable(factory):
        raise ValueError(f"--model {name}: {module_name} has no callable {factory_name!r}")
    return factory


def _check_hf_folder(name: str, folder: Path) -> None:
    """A Hugging Face folder stagewise reads as data: a config.json that names no code of its own (``auto_map``,
    which transformers would import with ``trust_remote_code``; stagewise never turns that on)."""
    path = folder / "config.json"
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        missing = f"--model {name}: {folder} holds no config.json; give a folder save_pretrained wrote"
        raise ValueError(missing) from None
    except (OSError, ValueError) as err:
        raise ValueError(f"--model {name}: cannot read {path} as JSON ({err})") from err
    if not isinstance(config, dict):
        raise ValueError(f"--model {name}: {path} holds a JSON {type(config).__name__}, not a config")
    if "auto_map" in config:
        raise ValueError(
            f"--model {name}: {path} names code of its own (auto_map {sorted(config['auto_map'])}), which stagewise "
            "never runs (no trust_remote_code); use a model class transformers ships, or build the model in your "
            "own code and train it with --model MODULE:FACTORY"
        )


def model_of(name: str) -> ModelConfig | UserModel:
    """The model a run names: a preset, ``hf:DIR`` (a local Hugging Face folder) or ``MODULE:FACTORY``."""
    if name in PRESETS:
        return preset(name)
    if name.startswith(HF):
        folder = Path(name[len(HF) :])
        _check_hf_folder(name, folder)
        return UserModel(name)
    module_name, _, factory_name = name.partition(":")
    if module_name and factory_name:
        return UserModel(name)
    raise ValueError(
        f"unknown model {name!r}: give a preset ({', '.join(sorted(PRESETS))}), hf:DIR (a local Hugging Face "
        "folder) or MODULE:FACTORY (a function returning the model)"
    )
