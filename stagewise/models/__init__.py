"""Reference models that split cleanly into pipeline stages, their presets, and their data."""

from stagewise.models.cnn import CNNConfig, SmallCNN
from stagewise.models.gpt import GPT, Block, Embedding, GPTConfig
from stagewise.models.mlp import MLPConfig, ResidualMLP
from stagewise.models.presets import PRESETS, ModelConfig, build, preset

__all__ = [
    "GPT",
    "PRESETS",
    "Block",
    "CNNConfig",
    "Embedding",
    "GPTConfig",
    "MLPConfig",
    "ModelConfig",
    "ResidualMLP",
    "SmallCNN",
    "build",
    "preset",
]
