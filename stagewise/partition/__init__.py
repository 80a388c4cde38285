"""Split a chain of layers, or a traced model, into pipeline stages: exact, balanced, memory-aware (pure)."""

from stagewise.partition.auto import By, auto, balance_costs, params_of
from stagewise.partition.balance import CapacityError, balance
from stagewise.partition.capture import Segment, TracedChain, repeated_blocks, trace
from stagewise.partition.graph import TraceError
from stagewise.partition.layers import (
    CHAIN_ATTRIBUTE,
    LAYERS_METHOD,
    Layer,
    SharedParameter,
    layers_of,
    shared_parameters,
)
from stagewise.partition.live_bytes import LiveBytes
from stagewise.partition.memory import MemoryModel, MemorySchedule, in_flight, memory_model
from stagewise.partition.profile import LayerCost, Payload, profile
from stagewise.partition.shared_cost import Tie
from stagewise.partition.split import Partition

__all__ = [
    "CHAIN_ATTRIBUTE",
    "LAYERS_METHOD",
    "By",
    "CapacityError",
    "Layer",
    "LayerCost",
    "LiveBytes",
    "MemoryModel",
    "MemorySchedule",
    "Partition",
    "Payload",
    "Segment",
    "SharedParameter",
    "Tie",
    "TraceError",
    "TracedChain",
    "auto",
    "balance",
    "balance_costs",
    "in_flight",
    "layers_of",
    "memory_model",
    "params_of",
    "profile",
    "repeated_blocks",
    "shared_parameters",
    "trace",
]
