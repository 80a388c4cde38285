"""Split a chain of layers into pipeline stages: exact, balanced and memory-aware (no process groups)."""

from stagewise.partition.auto import By, auto, balance_costs
from stagewise.partition.balance import CapacityError, balance
from stagewise.partition.layers import CHAIN_ATTRIBUTE, Layer, SharedParameter, layers_of, shared_parameters
from stagewise.partition.memory import MemoryModel, MemorySchedule, in_flight, memory_model
from stagewise.partition.profile import LayerCost, Payload, profile
from stagewise.partition.split import Partition

__all__ = [
    "CHAIN_ATTRIBUTE",
    "By",
    "CapacityError",
    "Layer",
    "LayerCost",
    "MemoryModel",
    "MemorySchedule",
    "Partition",
    "Payload",
    "SharedParameter",
    "auto",
    "balance",
    "balance_costs",
    "in_flight",
    "layers_of",
    "memory_model",
    "profile",
    "shared_parameters",
]
