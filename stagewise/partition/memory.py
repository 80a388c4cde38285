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
    """Bytes a stage needs: its layers' fixed bytes plus what it holds for backward at its peak.

    A stage that pools no weight gradients holds ``in_flight[stage]``
    micro-batches' saved activations. One that pools (``held[stage] > 0``)
    also keeps, for each pooled backward, the inputs and output gradients of
    its pooled linears (``pooled`` bytes per layer) while autograd frees the
    rest; at most ``held[stage]`` micro-batches are in flight or pooled at
    once, so a layer with pooled bytes counts ``held * max(activation,
    pooled)``, and a layer without counts ``in_flight * activation`` as before.
    """

    fixed: tuple[float, ...]
    """Per layer: bytes held whatever runs (weights, gradients, optimizer state, buffers)."""
    activation: tuple[float, ...]
    """Per layer: bytes saved for backward by one micro-batch."""
    in_flight: tuple[int, ...]
    """Per stage: micro-batches whose saved activations the stage holds at its peak."""
    pooled: tuple[float, ...] = ()
    """Per layer: bytes a pooled backward keeps until its pool is flushed; empty: none anywhere."""
    held: tuple[int, ...] = ()
    """Per stage: the most micro-batches in flight or pooled at once where the stage pools; 0 or empty: it does not."""

    def __post_init__(self) -> None:
        if len(self.fixed) != len(self.activation) or len(self.pooled) not in (0, len(self.fixed)):
            raise ValueError(
                f"MemoryModel has {len(self.fixed)} fixed sizes, {len(self.activation)} activation sizes and "
                f"{len(self.pooled)} pooled sizes; give one of each per layer (pooled may be empty)"
            )
        if len(self.held) not in (0, len(self.in_flight)):
            raise ValueError(
                f"MemoryModel has in-flight counts for {len(self.in_flight)} stages but held counts for "
                f"{len(self.held)}; give one per stage, or none"
            )
        for name in ("in_flight", "held"):
            counts = getattr(self, name)
            if any(q < 0 for q in counts):
                raise ValueError(f"{name} must be >= 0 for every stage, got {list(counts)}")

    @property
    def n_layers(self) -> int:
        return len(self.fixed)

    @property
    def n_stages(self) -> int:
        return len(self.in_flight)

    def pools(self, stage: int) -> bool:
        """Whether ``stage`` keeps pooled weight gradients."""
        return bool(self.held) and self.held[stage] > 0

    def terms(self) -> tuple[tuple[tuple[float, ...], tuple[float, ...]], ...]:
        """The held bytes as (per-layer bytes, per-stage count) pairs: a stage holds the sum of count x bytes."""
        q = tuple(float(c) for c in self.in_flight)
        if not self.pooled or not any(self.pools(s) for s in range(self.n_stages)):
            return ((self.activation, q),)
        poolable = tuple(p > 0 for p in self.pooled)
        plain = tuple(0.0 if m else a for a, m in zip(self.activation, poolable, strict=True))
        kept = tuple(a if m else 0.0 for a, m in zip(self.activation, poolable, strict=True))
        either = tuple(max(a, p) if m else 0.0 for a, p, m in zip(self.activation, self.pooled, poolable, strict=True))
        pooling = tuple(float(h) for h in self.held)
        return (
            (plain, q),
            (kept, tuple(0.0 if h else c for c, h in zip(q, pooling, strict=True))),
            (either, pooling),
        )

    def stage_bytes(self, stage: int, start: int, stop: int) -> float:
        """Bytes that layers ``start:stop`` need when they form stage ``stage``."""
        return sum(self.fixed[start:stop]) + sum(
            count[stage] * sum(per_layer[start:stop]) for per_layer, count in self.terms()
        )


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


def held(schedule: MemorySchedule, n_stages: int, n_microbatches: int) -> tuple[int, ...]:
    """Micro-batches each stage holds at its peak, in flight or pooled, under ``Pipeline``'s default pool; 0: no pool.

    The default (``WeightGradientFusion(pool="free")``) pools as many
    backwards on each rank as keep it within the most micro-batches any rank
    holds in flight. GPipe pools the whole step, so each stage holds ``m``.
    1F1B with ``m > p`` pools nothing on stage 0 and lets every other stage
    fill up to stage 0's ``p``; with ``m <= p`` every forward comes first, as
    in GPipe. Zero-bubble's W computes each micro-batch's own: nothing pooled.
    A single backward pools nothing either. ``stagewise.pipeline.peak_held``
    gives the same counts for any schedule, from its actions.
    """
    flights = in_flight(schedule, n_stages, n_microbatches)
    m = n_microbatches
    if schedule == "zero-bubble" or m == 1:
        return (0,) * n_stages
    if schedule == "gpipe" or m <= n_stages:
        return (m,) * n_stages
    return tuple(0 if s == 0 else flights[0] for s in range(n_stages))


def memory_model(
    costs: Sequence[LayerCost],
    n_stages: int,
    *,
    schedule: MemorySchedule = "1f1b",
    n_microbatches: int = 1,
    state_multiplier: float = 4.0,
    pooled: bool = True,
) -> MemoryModel:
    """The memory model of profiled layers run under ``schedule``.

    ``state_multiplier`` counts the copies of each parameter a stage keeps:
    4 for fp32 Adam (weights, gradients and two moments), 2 for plain SGD.
    Buffers are counted once; saved activations once per micro-batch in flight.
    ``pooled`` counts the weight gradients that ``Pipeline``'s default fusion
    pools (see :func:`held` and :attr:`LayerCost.pooled_bytes`); turn it off
    for a pipeline that pools nothing beyond its micro-batches in flight.
    """
    if state_multiplier < 0:
        raise ValueError(f"state_multiplier must be >= 0, got {state_multiplier}")
    return MemoryModel(
        fixed=tuple(c.param_bytes * state_multiplier + c.buffer_bytes for c in costs),
        activation=tuple(float(c.saved_bytes) for c in costs),
        in_flight=in_flight(schedule, n_stages, n_microbatches),
        pooled=tuple(float(c.pooled_bytes) for c in costs) if pooled else (),
        held=held(schedule, n_stages, n_microbatches) if pooled else (),
    )
