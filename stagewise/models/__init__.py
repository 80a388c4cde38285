"""Reference models that split cleanly into pipeline stages, and their presets."""

from stagewise.models.cnn import CNNConfig, SmallCNN
from stagewise.models.gpt import GPT, GPTConfig
from stagewise.models.mlp import MLPConfig, ResidualMLP
from stagewise.models.moe import MoEConfig
from stagewise.models.presets import PRESETS, ModelConfig, build, preset

__all__ = [
    "GPT",
    "PRESETS",
    "CNNConfig",
    "GPTConfig",
    "MLPConfig",
    "MoEConfig",
    "ModelConfig",
    "ResidualMLP",
    "SmallCNN",
    "build",
    "preset",
]
