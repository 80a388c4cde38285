"""synthesise(): a schedule for measured, unequal stage times within each rank's memory, no slower than a builtin."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stagewise.schedule import StageCosts, build, peak_in_flight, simulate, synthesise, validate


def heavy_ends(n_stages: int) -> StageCosts:
    """A real partition's shape: a light first stage (the embedding) and a heavy last one (the head and the loss)."""
    forward = [1.0] * n_stages
    forward[0], forward[-1] = 0.6, 1.8
    return StageCosts.of(n_stages, forward=forward, input_grad=forward, weight_grad=[0.8 * f for f in forward],
                         transfer=0.05)  # fmt: skip


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 4), st.integers(1, 12), st.sampled_from([1, 2]), st.integers(1, 5), st.data())
def test_the_synthesised_schedule_validates_fits_and_is_no_slower_than_any_builtin_that_fits(
    p: int, m: int, v: int, limit: int, data: st.DataObject
) -> None:
    n = p * v
    forward = data.draw(st.lists(st.floats(0.1, 3.0), min_size=n, max_size=n))
    costs = StageCosts.of(n, forward=forward, input_grad=forward, weight_grad=[0.5 * f for f in forward], transfer=0.1)
    found = synthesise(costs, p, m, limit=limit)
    schedule = found.schedule
    validate(schedule)
    assert (schedule.n_ranks, schedule.n_stages, schedule.n_microbatches) == (p, n, m)
    peak = peak_in_flight(schedule)
    assert all(peak[s] <= limit for s in range(n))
    assert found.step_time == simulate(schedule, costs).step_time
    for name in ("gpipe", "1f1b", "zero-bubble", "interleaved-1f1b", "looped-bfs", "zbv"):
        try:
            builtin = build(name, n, m, n_virtual=v)  # type: ignore[arg-type]
        except ValueError:
            continue  # a shape it does not take
        if max(peak_in_flight(builtin)) <= limit:
            assert found.step_time <= simulate(builtin, costs).step_time + 1e-9, name


@pytest.mark.parametrize(("p", "m", "v"), [(2, 8, 1), (4, 8, 1), (4, 16, 1), (4, 16, 2)])
def test_on_unequal_stages_it_beats_the_best_builtin(p: int, m: int, v: int) -> None:
    found = synthesise(heavy_ends(p * v), p, m, limit=p * v)  # 1F1B's memory; with 2 stages a rank, the V's
    assert found.builtin is not None and found.builtin_step_time is not None
    assert found.step_time < found.builtin_step_time


def test_bad_shapes_and_limits_are_refused() -> None:
    with pytest.raises(ValueError, match=r"5 stages do not spread evenly over 2 ranks; give a multiple of 2"):
        synthesise(heavy_ends(5), 2, 4)
    with pytest.raises(ValueError, match=r"limit must be one number >= 1 or one per rank \(2\), got \[1, 0\]"):
        synthesise(heavy_ends(2), 2, 4, limit=[1, 0])
    with pytest.raises(ValueError, match=r"limit must be one number >= 1 or one per rank \(2\), got \[1\]"):
        synthesise(heavy_ends(2), 2, 4, limit=[1])
