"""Reference models that split cleanly into pipeline stages, their presets, and their data."""

from stagewise.models.cnn import CNNConfig, SmallCNN
from stagewise.models.gpt import GPT, Block, Embedding, GPTConfig
from stagewise.models.mlp import MLPConfig, ResidualMLP
from stagewise.models.presets import PRESETS, ModelConfig, build, preset
from stagewise.models.synthetic import pattern_images, teacher_regression
from stagewise.models.text import ByteText, TextSplits, read_corpus, standard_library, text_splits

__all__ = [
    "GPT",
    "PRESETS",
    "Block",
    "ByteText",
    "CNNConfig",
    "Embedding",
    "GPTConfig",
    "MLPConfig",
    "ModelConfig",
    "ResidualMLP",
    "SmallCNN",
    "TextSplits",
    "build",
    "pattern_images",
    "preset",
    "read_corpus",
    "standard_library",
    "teacher_regression",
    "text_splits",
]
