"""Split a chain of layers, or a captured model, into pipeline stages: exact, balanced, memory-aware (pure)."""

from stagewise.partition.auto import By, auto, balance_costs, params_of
from stagewise.partition.balance import CapacityError, balance
from stagewise.partition.capture import CapturedChain, capture, repeated_blocks
from stagewise.partition.graph import CaptureError
from stagewise.partition.layers import (
    CHAIN_ATTRIBUTE,
    LAYERS_METHOD,
    Layer,
    Payload,
    SharedParameter,
    layers_of,
    shared_parameters,
)
from stagewise.partition.live_bytes import LiveBytes
from stagewise.partition.memory import MemoryModel, MemorySetting, memory_model
from stagewise.partition.profile import LayerCost, profile
from stagewise.partition.segment import Segment
from stagewise.partition.shared_cost import Tie
from stagewise.partition.split import Partition

__all__ = [
    "CHAIN_ATTRIBUTE",
    "LAYERS_METHOD",
    "By",
    "CapacityError",
    "CaptureError",
    "CapturedChain",
    "Layer",
    "LayerCost",
    "LiveBytes",
    "MemoryModel",
    "MemorySetting",
    "Partition",
    "Payload",
    "Segment",
    "SharedParameter",
    "Tie",
    "auto",
    "balance",
    "balance_costs",
    "capture",
    "layers_of",
    "memory_model",
    "params_of",
    "profile",
    "repeated_blocks",
    "shared_parameters",
]
