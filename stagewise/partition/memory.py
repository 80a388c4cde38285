"""Per-stage memory model: parameter state plus activations of the micro-batches a stage holds."""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from stagewise.errors import is_whole
from stagewise.partition.layer_cost import LayerCost
from stagewise.partition.layers import SharedParameter
from stagewise.partition.shared_cost import Tie, check_ties
from stagewise.schedule import Schedule, peak_in_flight
from stagewise.schedule.holdings import Holding


def split_waiting_bytes(cost: LayerCost) -> int:
    """Bytes one micro-batch keeps in ``cost``'s layer from a split backward's input pass (I) to its weight pass
    (W), on top of its saved activations: the gradients of the outputs of the ops that read a parameter (the
    pooled linears' output gradients and :attr:`LayerCost.use_bytes`), and the pooled linears' inputs where the
    layer does not save them already (:attr:`LayerCost.pooled_input_bytes`: I keeps the forward's graph, and
    its saved activations, for W)."""
    return cost.pooled_bytes - cost.pooled_input_bytes + cost.use_bytes


@dataclass(frozen=True)
class MemoryModel:
    """Bytes a stage needs: its layers' fixed bytes plus what it holds for backward at its fullest moment.

    At a moment (:class:`Holding`) with ``a`` micro-batches in flight and
    ``b`` pooled backwards, a stage holds ``a * sum(activation) + b *
    sum(pooled)`` over its layers; it needs the most of that over its
    ``holdings``. Without them a stage's one moment is its ``in_flight``
    micro-batches and no pool.
    """

    fixed: tuple[float, ...]
    """Per layer: bytes held whatever runs (weights, gradients, optimizer state, buffers)."""
    activation: tuple[float, ...]
    """Per layer: bytes saved for backward by one micro-batch."""
    in_flight: tuple[int, ...]
    """Per stage: micro-batches whose saved activations the stage holds at its peak."""
    pooled: tuple[float, ...] = ()
    """Per layer: bytes a pooled backward keeps until its pool is flushed (:attr:`LayerCost.pooled_bytes`), or,
    where the schedule splits its backward, a micro-batch waiting for W (:func:`split_waiting_bytes`); empty:
    none."""
    holdings: tuple[tuple[Holding, ...], ...] = ()
    """Per stage: the moments that can be its fullest (``stagewise.schedule.holdings`` works them out from a
    schedule and its weight-gradient pool); empty: ``Holding(in_flight[stage])`` alone."""
    shared: tuple[float, ...] = ()
    """Per layer: bytes of ``activation`` that the layer before it saves too (:attr:`LayerCost.shared_bytes`),
    held once when both are on one stage; at most either layer's activation, and ignored for the first layer
    (nothing comes before it). Empty: none."""
    ties: tuple[Tie, ...] = ()
    """Bytes of ``fixed`` that several layers count and a stage holding any of them counts once: tied
    parameters with their gradients and optimizer state. ``Pipeline`` keeps one copy per rank, so with
    several stages per rank (interleaved) counting per stage errs on the safe side."""

    def __post_init__(self) -> None:
        if len(self.fixed) != len(self.activation) or len(self.pooled) not in (0, len(self.fixed)):
            raise ValueError(
                f"MemoryModel has {len(self.fixed)} fixed sizes, {len(self.activation)} activation sizes and "
                f"{len(self.pooled)} pooled sizes; give one of each per layer (pooled may be empty)"
            )
        if any(q < 0 for q in self.in_flight):
            raise ValueError(f"in_flight must be >= 0 for every stage, got {list(self.in_flight)}")
        if len(self.shared) not in (0, len(self.fixed)):
            raise ValueError(
                f"MemoryModel has {len(self.shared)} shared sizes for {len(self.fixed)} layers; give one per layer "
                "or none"
            )
        for i in range(1, len(self.shared)):
            most = min(self.activation[i - 1], self.activation[i])
            if not 0 <= self.shared[i] <= most:  # also refuses NaN
                raise ValueError(
                    f"shared[{i}] = {self.shared[i]} must be between 0 and the activation of layer {i} and of the "
                    f"layer before it ({most}): it is bytes both layers save"
                )
        check_ties("MemoryModel.ties", self.ties, self.fixed)
        if self.holdings and len(self.holdings) != len(self.in_flight):
            raise ValueError(
                f"MemoryModel has in-flight counts for {len(self.in_flight)} stages but holdings for "
                f"{len(self.holdings)}; give one tuple of moments per stage, or none"
            )
        for stage, moments in enumerate(self.holdings):
            if not moments or any(h.in_flight < 0 or h.pooled < 0 for h in moments):
                raise ValueError(f"holdings[{stage}] must be one or more moments with counts >= 0, got {list(moments)}")

    @property
    def n_layers(self) -> int:
        return len(self.fixed)

    @property
    def n_stages(self) -> int:
        return len(self.in_flight)

    def moments(self, stage: int) -> tuple[Holding, ...]:
        """The moments that can be ``stage``'s fullest."""
        return self.holdings[stage] if self.holdings else (Holding(self.in_flight[stage]),)

    def kept(self, start: int, stop: int) -> float:
        """Activation bytes that layers ``start:stop`` save for one micro-batch, a tensor two of them save once."""
        return sum(self.activation[start:stop]) - sum(self.shared[start + 1 : stop])

    def fixed_bytes(self, layers: Collection[int]) -> float:
        """Fixed bytes of ``layers`` (indices: a stage's ``range(start, stop)``, or a rank's stages together), a tie
        among them counted once."""
        return sum(self.fixed[i] for i in layers) - sum(tie.repeated(layers) for tie in self.ties)

    def stage_bytes(self, stage: int, start: int, stop: int) -> float:
        """Bytes that layers ``start:stop`` need when they form stage ``stage``."""
        kept = self.kept(start, stop)
        pooled = sum(self.pooled[start:stop])
        return self.fixed_bytes(range(start, stop)) + max(
            h.in_flight * kept + h.pooled * pooled for h in self.moments(stage)
        )


@dataclass(frozen=True)
class MemorySetting:
    """How :func:`~stagewise.partition.balance_costs` and :func:`~stagewise.partition.auto` count a stage's
    memory: the arguments of :func:`memory_model` that do not come from the model.

    For 1F1B over 8 stages with 16 micro-batches and ``Pipeline``'s default
    weight-gradient pool::

        schedule = build("1f1b", 8, 16)
        MemorySetting(schedule, holdings(schedule))
    """

    schedule: Schedule | None = None
    """The built schedule the stages run (``stagewise.schedule.build``), whose own actions say how many
    micro-batches each stage holds; None: one each."""
    holdings: tuple[tuple[Holding, ...], ...] | None = None
    """``stagewise.schedule.holdings(schedule, ...)``: also count pooled weight gradients; None: only the
    micro-batches in flight."""
    state_multiplier: float = 4.0
    """Copies of each parameter a stage keeps: 4 for fp32 Adam (weights, gradients and two moments), 2 for SGD."""

    def model(self, costs: Sequence[LayerCost], n_stages: int, shared: Sequence[SharedParameter] = ()) -> MemoryModel:
        """The :func:`memory_model` of ``costs`` over ``n_stages`` stages under this setting."""
        if self.schedule is not None and self.schedule.n_stages != n_stages:
            raise ValueError(
                f"the memory setting's schedule {self.schedule.name!r} has {self.schedule.n_stages} stages but the "
                f"partition has {n_stages}; build the schedule for {n_stages} stages"
            )
        return memory_model(
            costs,
            n_stages,
            schedule=self.schedule,
            holdings=self.holdings,
            state_multiplier=self.state_multiplier,
            shared=shared,
        )


def _stages_in_flight(n_stages: int | None, schedule: Schedule | None) -> tuple[int, ...]:
    """Per stage: the micro-batches whose activations it holds at its peak, as ``schedule`` runs them."""
    if schedule is None:
        if not is_whole(n_stages):
            raise TypeError(
                f"memory_model needs n_stages (an int) or schedule=stagewise.schedule.build(...), got n_stages="
                f"{n_stages!r}"
            )
        if n_stages < 1:
            raise ValueError(f"n_stages must be >= 1, got {n_stages}")
        return (1,) * n_stages
    if not isinstance(schedule, Schedule):
        fix = f"build({schedule!r}, n_stages, n_microbatches)" if isinstance(schedule, str) else "build(...)"
        raise TypeError(
            f"schedule must be a built Schedule, got {type(schedule).__name__}: pass stagewise.schedule.{fix}"
        )
    if n_stages is not None and n_stages != schedule.n_stages:
        raise ValueError(
            f"n_stages={n_stages} but the schedule {schedule.name!r} has {schedule.n_stages} stages; leave n_stages "
            "out, or build the schedule for that many"
        )
    return peak_in_flight(schedule)


def memory_model(
    costs: Sequence[LayerCost],
    n_stages: int | None = None,
    *,
    schedule: Schedule | None = None,
    holdings: Sequence[Sequence[Holding]] | None = None,
    state_multiplier: float = 4.0,
    shared: Sequence[SharedParameter] = (),
) -> MemoryModel:
    """The memory model of profiled layers run under ``schedule``.

    ``schedule`` is a built :class:`~stagewise.schedule.Schedule`, e.g.
    ``build("1f1b", p, m)``: each stage holds the micro-batches its own
    actions keep in flight at its peak (``stagewise.schedule.peak_in_flight``;
    1F1B's stage ``s`` of ``p`` holds ``min(p - s, m)``, GPipe's ``m``,
    zero-bubble's ``min(2p - 1 - s, m)``). Without one, each of ``n_stages``
    stages holds one micro-batch; with one, ``n_stages`` may be left out.

    ``state_multiplier`` counts the copies of each parameter a stage keeps:
    4 for fp32 Adam (weights, gradients and two moments), 2 for plain SGD.
    Buffers are counted once; saved activations once per micro-batch in flight.
    ``holdings`` adds the weight gradients a pipeline pools
    (:attr:`LayerCost.pooled_bytes`; where the schedule splits its backward,
    :attr:`~stagewise.schedule.Schedule.splits_backward`, the output
    gradients its input pass keeps for its weight pass instead, :func:`split_waiting_bytes`):
    pass ``stagewise.schedule.holdings(schedule)`` for ``Pipeline``'s default;
    without it only the micro-batches in flight count. ``shared`` lists the
    parameters layers share (:func:`~stagewise.partition.shared_parameters`),
    which a stage counts once however many of its layers use them.

    Raises:
        TypeError: ``schedule`` is not a built schedule (a name, say), or neither it nor ``n_stages`` is given.
        ValueError: ``n_stages`` disagrees with the schedule, ``holdings`` come without their schedule, or
            ``state_multiplier`` is negative or not finite.
    """
    if not 0 <= state_multiplier < math.inf:  # also refuses NaN
        raise ValueError(f"state_multiplier must be >= 0 and finite, got {state_multiplier}")
    in_flight = _stages_in_flight(n_stages, schedule)
    if holdings is not None and schedule is None:
        raise ValueError(
            "holdings come from a schedule: pass it too (schedule=...), so that a split backward's bytes count"
        )
    splits = schedule is not None and schedule.splits_backward
    return MemoryModel(
        fixed=tuple(c.param_bytes * state_multiplier + c.buffer_bytes for c in costs),
        activation=tuple(float(c.saved_bytes) for c in costs),
        in_flight=in_flight,
        pooled=()
        if holdings is None
        else tuple(float(split_waiting_bytes(c) if splits else c.pooled_bytes) for c in costs),
        holdings=() if holdings is None else tuple(tuple(moments) for moments in holdings),
        shared=tuple(float(c.shared_bytes) for c in costs),
        ties=tuple(Tie(tie.indices, tie.nbytes * state_multiplier) for tie in shared),
    )
