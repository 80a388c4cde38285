"""Reference models that split cleanly into pipeline stages."""

from stagewise.models.gpt import GPT, Block, Embedding, GPTConfig
from stagewise.models.presets import PRESETS, build

__all__ = ["GPT", "PRESETS", "Block", "Embedding", "GPTConfig", "build"]
