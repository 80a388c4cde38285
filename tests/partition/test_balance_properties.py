"""balance() against brute-force enumeration of every split, on random inputs."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from stagewise.partition import CapacityError, MemoryModel, Tie, balance
from stagewise.schedule.holdings import Holding

# Integer-valued weights and memory make every sum exact in float64, so the
# brute force and the solver agree to the bit, ties included.
small_int = st.integers(min_value=0, max_value=20).map(float)


def splits(n: int, k: int) -> list[tuple[int, ...]]:
    return [(0, *cuts, n) for cuts in itertools.combinations(range(1, n), k - 1)]


def counted(values: list[float] | tuple[float, ...], ties: Sequence[Tie], start: int, stop: int) -> float:
    """``values`` summed over layers ``start:stop``, a tie's amount counted once however many of its layers are in."""
    repeats = sum(tie.amount * max(len([i for i in tie.layers if start <= i < stop]) - 1, 0) for tie in ties)
    return sum(values[start:stop]) - repeats


def need(memory: MemoryModel, stage: int, start: int, stop: int) -> float:
    """The documented bytes of layers ``start:stop`` as ``stage``: fixed, plus its fullest moment."""
    moments = memory.holdings[stage] if memory.holdings else (Holding(memory.in_flight[stage]),)
    pooled = memory.pooled or (0.0,) * memory.n_layers
    shared = memory.shared or (0.0,) * memory.n_layers
    # A tensor that two neighbouring layers of the stage save is held once: the second's shared bytes go.
    kept = sum(memory.activation[start:stop]) - sum(shared[i] for i in range(start + 1, stop))
    fullest = max(h.in_flight * kept + h.pooled * sum(pooled[start:stop]) for h in moments)
    return counted(memory.fixed, memory.ties, start, stop) + fullest


def brute(
    weights: list[float],
    k: int,
    speeds: list[float],
    memory: MemoryModel | None,
    capacities: list[float] | None,
    *,
    ties: Sequence[Tie] = (),
) -> tuple[float | None, list[tuple[int, ...]]]:
    """The optimal bottleneck and every split that reaches it (None: no split fits)."""
    best: float | None = None
    winners: list[tuple[int, ...]] = []
    for b in splits(len(weights), k):
        if (
            memory is not None
            and capacities is not None
            and any(need(memory, j, b[j], b[j + 1]) > capacities[j] for j in range(k))
        ):
            continue
        worst = max(counted(weights, ties, b[j], b[j + 1]) / speeds[j] for j in range(k))
        if best is None or worst < best:
            best, winners = worst, [b]
        elif worst == best:
            winners.append(b)
    return best, winners


def draw_ties(draw: st.DrawFn, values: list[float]) -> tuple[Tie, ...]:
    """Up to two ties among ``values``; a layer's ties add up to at most its value (whole numbers)."""
    ties = []
    left = list(values)
    for _ in range(draw(st.integers(0, 2))):
        layers = sorted(draw(st.sets(st.integers(0, len(values) - 1), min_size=1, max_size=len(values))))
        amount = float(draw(st.integers(0, int(min(left[i] for i in layers)))))
        for i in layers:
            left[i] -= amount
        ties.append(Tie(tuple(layers), amount))
    return tuple(ties)


@st.composite
def problems(draw: st.DrawFn, with_speeds: bool, with_capacities: bool) -> dict[str, object]:
    n = draw(st.integers(1, 12))
    k = draw(st.integers(1, min(6, n)))
    weights = draw(st.lists(small_int, min_size=n, max_size=n))
    speeds = (
        draw(st.lists(st.sampled_from([0.5, 1.0, 2.0, 3.0, 0.25]), min_size=k, max_size=k)) if with_speeds else None
    )
    ties = draw_ties(draw, weights)  # tied parameters, when balancing parameters
    memory = capacities = None
    if with_capacities:
        pooling = draw(st.booleans())  # stages whose fullest moment may hold pooled weight gradients
        moment = st.builds(Holding, st.integers(0, 4), st.integers(0, 4))
        activation = draw(st.lists(small_int, min_size=n, max_size=n))
        sharing = draw(st.booleans())  # neighbours that save a tensor both, held once on one stage
        shared = [0.0] + [float(draw(st.integers(0, int(min(a, b))))) for a, b in itertools.pairwise(activation)]
        fixed = draw(st.lists(small_int, min_size=n, max_size=n))
        memory = MemoryModel(
            fixed=tuple(fixed),
            ties=draw_ties(draw, fixed),
            activation=tuple(activation),
            shared=tuple(shared) if sharing else (),
            in_flight=tuple(draw(st.lists(st.integers(0, 4), min_size=k, max_size=k))),
            pooled=tuple(draw(st.lists(small_int, min_size=n, max_size=n))) if pooling else (),
            holdings=tuple(tuple(draw(st.lists(moment, min_size=1, max_size=3))) for _ in range(k)) if pooling else (),
        )
        capacities = draw(st.lists(st.integers(1, 150).map(float), min_size=k, max_size=k))
    return {"weights": weights, "k": k, "speeds": speeds, "memory": memory, "capacities": capacities, "ties": ties}


def check_against_brute(p: dict[str, object]) -> None:
    weights, k = p["weights"], p["k"]
    assert isinstance(weights, list) and isinstance(k, int)
    speeds = p["speeds"]
    memory, capacities, ties = p["memory"], p["capacities"], p["ties"]
    assert memory is None or isinstance(memory, MemoryModel)
    assert isinstance(ties, tuple)
    best, winners = brute(weights, k, speeds or [1.0] * k, memory, capacities, ties=ties)  # type: ignore[arg-type]
    if best is None:
        with pytest.raises(CapacityError):
            balance(weights, k, speeds=speeds, memory=memory, capacities=capacities, ties=ties)  # type: ignore[arg-type]
        return
    part = balance(weights, k, speeds=speeds, memory=memory, capacities=capacities, ties=ties)  # type: ignore[arg-type]
    assert part.bottleneck == best
    # Valid: covers every layer in order, no empty stage, capacities hold.
    b = part.bounds
    assert b[0] == 0 and b[-1] == len(weights) and len(b) == k + 1
    assert all(b[j] < b[j + 1] for j in range(k))
    assert part.loads == tuple(counted(weights, ties, b[j], b[j + 1]) for j in range(k))
    if memory is not None and capacities is not None:
        assert all(need(memory, j, b[j], b[j + 1]) <= capacities[j] for j in range(k))
        assert part.memory == tuple(need(memory, j, b[j], b[j + 1]) for j in range(k))
        assert all(memory.stage_bytes(j, b[j], b[j + 1]) == need(memory, j, b[j], b[j + 1]) for j in range(k))
    # The documented tie-break: backwards from the last stage, each starts as early as it can.
    assert b == min(winners, key=lambda w: tuple(reversed(w)))


@settings(max_examples=400, deadline=None)
@given(problems(with_speeds=False, with_capacities=False))
def test_equals_brute_force(p: dict[str, object]) -> None:
    check_against_brute(p)


@settings(max_examples=400, deadline=None)
@given(problems(with_speeds=True, with_capacities=False))
def test_equals_brute_force_with_speeds(p: dict[str, object]) -> None:
    check_against_brute(p)


@settings(max_examples=400, deadline=None)
@given(problems(with_speeds=False, with_capacities=True))
def test_equals_brute_force_with_capacities(p: dict[str, object]) -> None:
    check_against_brute(p)


@settings(max_examples=400, deadline=None)
@given(problems(with_speeds=True, with_capacities=True))
def test_equals_brute_force_with_speeds_and_capacities(p: dict[str, object]) -> None:
    check_against_brute(p)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.floats(0, 1e6, allow_nan=False, allow_infinity=False), min_size=1, max_size=12),
    st.integers(1, 6),
)
def test_equals_brute_force_on_real_floats(weights: list[float], k: int) -> None:
    assume(k <= len(weights))
    best, _ = brute(weights, k, [1.0] * k, None, None)
    assert best is not None
    assert math.isclose(balance(weights, k).bottleneck, best, rel_tol=1e-12, abs_tol=1e-300)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.floats(0, 1e6, allow_nan=False, allow_infinity=False), min_size=2, max_size=12),
    st.integers(1, 6),
    st.data(),
)
def test_ties_on_real_floats(weights: list[float], k: int, data: st.DataObject) -> None:
    """A tie as large as a layer's whole weight (an embedding's only parameter) rounds without losing the optimum."""
    assume(k <= len(weights))
    layers = sorted(data.draw(st.sets(st.integers(0, len(weights) - 1), min_size=2, max_size=len(weights))))
    amount = min(weights[i] for i in layers)
    ties = (Tie(tuple(layers), amount),)
    best, _ = brute(weights, k, [1.0] * k, None, None, ties=ties)
    assert best is not None
    assert math.isclose(balance(weights, k, ties=ties).bottleneck, best, rel_tol=1e-9, abs_tol=1e-6)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(small_int, min_size=2, max_size=12),
    st.integers(1, 5),
    st.lists(small_int, min_size=12, max_size=12),
    st.integers(1, 200).map(float),
)
def test_adding_a_stage_never_raises_the_bottleneck(
    weights: list[float], k: int, memory: list[float], capacity: float
) -> None:
    n = len(weights)
    assume(k + 1 <= n)
    mem = memory[:n]
    try:
        fewer = balance(weights, k, memory=mem, capacities=[capacity] * k)
    except CapacityError:
        return
    more = balance(weights, k + 1, memory=mem, capacities=[capacity] * (k + 1))
    assert more.bottleneck <= fewer.bottleneck


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.floats(0, 1e6, allow_nan=False), min_size=1, max_size=12),
    st.integers(1, 6),
    st.sampled_from([0.5, 2.0, 1024.0, 3.0, 1e-3]),
)
def test_scaling_weights_scales_the_bottleneck(weights: list[float], k: int, factor: float) -> None:
    assume(k <= len(weights))
    base = balance(weights, k).bottleneck
    scaled = balance([w * factor for w in weights], k).bottleneck
    assert math.isclose(scaled, base * factor, rel_tol=1e-12, abs_tol=1e-300)


def test_shared_activations_in_gib_fit_where_the_formula_says() -> None:
    # Fractions of a GiB: the prefix sums round, and the stage's bytes once came out a little higher when the
    # range started one layer earlier, which broke the search ("reachable sets and witness disagree").
    memory = MemoryModel((0.0,) * 4, (0.3, 0.5, 0.1, 0.5), (1,), shared=(0.0, 0.3, 0.1, 0.1))
    assert balance(memory, 1, memory=memory, capacities=[0.9]).bounds == (0, 4)


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_shared_activations_on_real_floats(data: st.DataObject) -> None:
    """Float activations that neighbours share: the search never fails, and every split it could take fits."""
    n = data.draw(st.integers(2, 8))
    k = data.draw(st.integers(1, min(4, n)))
    value = st.one_of(st.floats(0, 1), st.floats(0, 1e6), st.sampled_from([0.1, 0.3, 0.5, 0.7]))
    activation = data.draw(st.lists(value, min_size=n, max_size=n))
    shared = [0.0] + [
        min(a, b) * data.draw(st.sampled_from([0.0, 0.5, 1.0])) for a, b in itertools.pairwise(activation)
    ]
    memory = MemoryModel(
        fixed=tuple(data.draw(st.lists(value, min_size=n, max_size=n))),
        activation=tuple(activation),
        in_flight=tuple(data.draw(st.lists(st.integers(1, 3), min_size=k, max_size=k))),
        shared=tuple(shared),
    )
    chosen = data.draw(st.sampled_from(splits(n, k)))
    # Prefix sums round by about an ulp of the whole model's bytes: give that much room, and never none.
    slack = 1e-9 * (sum(memory.fixed) + 3 * sum(activation)) + 1e-300
    room = [memory.stage_bytes(j, chosen[j], chosen[j + 1]) * (1 + 1e-9) + slack for j in range(k)]
    part = balance(memory, k, memory=memory, capacities=room)  # the chosen split fits, so some split does
    assert part.memory is not None and all(m <= c for m, c in zip(part.memory, room, strict=True))
    assert part.bottleneck <= max(room)
