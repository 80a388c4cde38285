"""Split a chain of layers, or a captured model, into pipeline stages: exact, balanced, memory-aware (pure)."""

from stagewise.partition.auto import By, auto, balance_costs
from stagewise.partition.balance import CapacityError, balance
from stagewise.partition.capture import CapturedChain, capture
from stagewise.partition.graph import CaptureError
from stagewise.partition.layer_cost import LayerCost
from stagewise.partition.layers import Layer, layers_of, shared_parameters
from stagewise.partition.memory import MemoryModel, MemorySetting, memory_model
from stagewise.partition.profile import profile
from stagewise.partition.shared_cost import Tie
from stagewise.partition.split import Partition

__all__ = [
    "By",
    "CapacityError",
    "CaptureError",
    "CapturedChain",
    "Layer",
    "LayerCost",
    "MemoryModel",
    "MemorySetting",
    "Partition",
    "Tie",
    "auto",
    "balance",
    "balance_costs",
    "capture",
    "layers_of",
    "memory_model",
    "profile",
    "shared_parameters",
]
