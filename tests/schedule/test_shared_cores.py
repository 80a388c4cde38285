"""Ranks taking turns on fewer cores than they are: a rank computing alone runs faster than among all busy."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stagewise.schedule import SharedCores, StageCosts, build, simulate

SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("zero-bubble", 1), ("interleaved-1f1b", 2), ("zbv", 2), ("dualpipev", 2)]


def test_a_lone_rank_in_the_bubble_runs_on_the_cores_the_waiting_rank_leaves() -> None:
    # 1F1B over 2 pipeline ranks of 2 processes each on 2 cores, costs measured with all 4 busy: a rank computing
    # alone runs twice as fast. Worked by hand: F0 alone (0.5), then both ranks at the costs' speed, ending
    # with B3 of rank 1 and of rank 0 alone (0.5 + 1.0): 12 seconds against 15 at fixed durations.
    schedule = build("1f1b", 2, 4)
    costs = StageCosts.of(2, forward=1.0, backward=2.0)
    shared = simulate(schedule, costs, cores=SharedCores(cores=2, processes_per_rank=2, profiled=4))
    assert simulate(schedule, costs).step_time == pytest.approx(15.0)
    assert shared.step_time == pytest.approx(12.0)
    first = next(e for e in shared.timeline if e.rank == 0)
    assert (first.start, first.end) == pytest.approx((0.0, 0.5))
    last = max(shared.timeline, key=lambda e: e.end)
    assert (last.rank, last.end - last.start) == pytest.approx((0, 1.0))


def test_more_ranks_than_the_costs_were_measured_with_run_slower() -> None:
    # Measured alone on one of 2 cores; 4 processes then share them while both pipeline ranks compute.
    cores = SharedCores(cores=2, processes_per_rank=2, profiled=1)
    assert cores.speed(2) == pytest.approx(0.5)
    assert cores.speed(1) == pytest.approx(1.0)
    assert cores.fastest == pytest.approx(1.0)


@pytest.mark.parametrize("field", ["cores", "processes_per_rank", "profiled"])
def test_a_count_below_one_is_refused_by_name(field: str) -> None:
    counts = {"cores": 2, "processes_per_rank": 1, "profiled": 2} | {field: 0}
    with pytest.raises(ValueError, match=field):
        SharedCores(**counts)


@settings(max_examples=60, deadline=None)
@given(
    which=st.sampled_from(SCHEDULES),
    pp=st.sampled_from([2, 4]),
    m=st.sampled_from([4, 8]),
    forward=st.lists(st.floats(0.1, 3.0), min_size=8, max_size=8),
    transfer=st.floats(0.0, 0.5),
    cores=st.integers(1, 8),
    per_rank=st.integers(1, 4),
)
def test_sharing_lies_between_the_fixed_durations_and_every_rank_at_the_lone_speed(
    which: tuple[str, int], pp: int, m: int, forward: list[float], transfer: float, cores: int, per_rank: int
) -> None:
    name, v = which
    if name == "dualpipev" and m < 2 * pp:
        m = 2 * pp
    schedule = build(name, pp, m, n_virtual=v)  # type: ignore[arg-type]
    n = schedule.n_stages
    costs = StageCosts.of(n, forward=forward[:n], backward=[2 * f for f in forward[:n]], transfer=transfer)
    plain = simulate(schedule, costs)
    # Measured with every process busy: no moment runs slower than the costs, none faster than a rank alone.
    shared = SharedCores(cores, per_rank, profiled=pp * per_rank)
    result = simulate(schedule, costs, cores=shared)
    assert plain.step_time / shared.fastest - 1e-9 <= result.step_time <= plain.step_time + 1e-9
    for rank, actions in enumerate(schedule.ranks):  # every action, each rank's in its order
        assert [e.action for e in sorted(result.timeline, key=lambda e: e.start) if e.rank == rank] == list(actions)
    # Cores enough for every process: the fixed durations exactly.
    roomy = simulate(schedule, costs, cores=SharedCores(pp * per_rank, per_rank, profiled=pp * per_rank))
    assert roomy.step_time == pytest.approx(plain.step_time, rel=1e-9)
