"""stagewise: split PyTorch models into balanced pipeline stages and train them across devices."""

from stagewise import models, partition
from stagewise.partition import LayerCost, Partition, auto, balance, layers_of, profile

__version__ = "0.1.0"

__all__ = [
    "LayerCost",
    "Partition",
    "__version__",
    "auto",
    "balance",
    "layers_of",
    "models",
    "partition",
    "profile",
]
