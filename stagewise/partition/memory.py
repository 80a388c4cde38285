"""Per-stage memory model: parameter state plus activations of the micro-batches a stage holds."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, get_args

from stagewise.partition.profile import LayerCost

MemorySchedule = Literal["gpipe", "1f1b", "zero-bubble"]
"""Schedules whose activation footprint has a closed form (see :func:`in_flight`)."""


@dataclass(frozen=True)
class MemoryModel:
    """Bytes a stage needs: ``sum(fixed) + in_flight[stage] * sum(activation)`` over its layers."""

    fixed: tuple[float, ...]
    """Per layer: bytes held whatever runs (weights, gradients, optimizer state, buffers)."""
    activation: tuple[float, ...]
    """Per layer: bytes saved for backward by one micro-batch."""
    in_flight: tuple[int, ...]
    """Per stage: micro-batches whose saved activations the stage holds at its peak."""

    def __post_init__(self) -> None:
        if len(self.fixed) != len(self.activation):
            raise ValueError(
                f"MemoryModel has {len(self.fixed)} fixed sizes but {len(self.activation)} activation "
                "sizes; give one of each per layer"
            )
        if any(q < 0 for q in self.in_flight):
            raise ValueError(f"in_flight must be >= 0 for every stage, got {list(self.in_flight)}")

    @property
    def n_layers(self) -> int:
        return len(self.fixed)

    @property
    def n_stages(self) -> int:
        return len(self.in_flight)

    def stage_bytes(self, stage: int, start: int, stop: int) -> float:
        """Bytes that layers ``start:stop`` need when they form stage ``stage``."""
        fixed = sum(self.fixed[start:stop])
        return fixed + self.in_flight[stage] * sum(self.activation[start:stop])


def in_flight(schedule: MemorySchedule, n_stages: int, n_microbatches: int) -> tuple[int, ...]:
    """Micro-batches whose activations each stage holds at its peak.

    GPipe runs every forward before any backward, so every stage holds all
    ``m`` micro-batches. 1F1B (and ZB-H1 zero-bubble, which keeps 1F1B's
    memory) lets stage ``s`` of ``p`` run at most ``p - s`` forwards ahead of
    its backwards, so it holds ``min(p - s, m)``.
    """
    if schedule not in get_args(MemorySchedule):
        raise ValueError(
            f"unknown schedule {schedule!r} for the memory model; choose one of {list(get_args(MemorySchedule))}"
        )
    if n_stages < 1:
        raise ValueError(f"n_stages must be >= 1, got {n_stages}")
    if n_microbatches < 1:
        raise ValueError(f"n_microbatches must be >= 1, got {n_microbatches}")
    if schedule == "gpipe":
        return (n_microbatches,) * n_stages
    return tuple(min(n_stages - s, n_microbatches) for s in range(n_stages))


def memory_model(
    costs: Sequence[LayerCost],
    n_stages: int,
    *,
    schedule: MemorySchedule = "1f1b",
    n_microbatches: int = 1,
    state_multiplier: float = 4.0,
) -> MemoryModel:
    """The memory model of profiled layers run under ``schedule``.

    ``state_multiplier`` counts the copies of each parameter a stage keeps:
    4 for fp32 Adam (weights, gradients and two moments), 2 for plain SGD.
    Buffers are counted once; saved activations once per micro-batch in flight.
    """
    if state_multiplier < 0:
        raise ValueError(f"state_multiplier must be >= 0, got {state_multiplier}")
    return MemoryModel(
        fixed=tuple(c.param_bytes * state_multiplier + c.buffer_bytes for c in costs),
        activation=tuple(float(c.saved_bytes) for c in costs),
        in_flight=in_flight(schedule, n_stages, n_microbatches),
    )
