"""stagewise: split PyTorch models into balanced pipeline stages and train them across devices."""

from stagewise import comm, models, partition, pipeline
from stagewise.partition import LayerCost, Partition, auto, balance, layers_of, profile
from stagewise.pipeline import Pipeline
from stagewise.planner import Plan, plan

__version__ = "0.1.0"

__all__ = [
    "LayerCost",
    "Partition",
    "Pipeline",
    "Plan",
    "__version__",
    "auto",
    "balance",
    "comm",
    "layers_of",
    "models",
    "partition",
    "pipeline",
    "plan",
    "profile",
]
