"""simulate(): timing, idle time, transfers, memory, and bad costs."""

from __future__ import annotations

import numpy as np
import pytest

from stagewise.schedule import Schedule, StageCosts, build, simulate


def test_two_stage_1f1b_by_hand() -> None:
    # Rank 0's backward of each micro-batch waits for rank 1's: B0 after [2, 4], B1 after [5, 7].
    result = simulate(build("1f1b", 2, 2), StageCosts.of(2, forward=1.0, backward=2.0))
    by_rank = {r: [(str(e.action), e.start, e.end) for e in result.timeline if e.rank == r] for r in (0, 1)}
    assert by_rank[1] == [("1F0", 1.0, 2.0), ("1B0", 2.0, 4.0), ("1F1", 4.0, 5.0), ("1B1", 5.0, 7.0)]
    assert by_rank[0] == [("0F0", 0.0, 1.0), ("0F1", 1.0, 2.0), ("0B0", 4.0, 6.0), ("0B1", 7.0, 9.0)]
    assert result.step_time == 9.0
    assert result.busy == (6.0, 6.0) and result.idle == (3.0, 3.0)
    assert result.bubble == pytest.approx(1 / 3)


def test_transfer_delays_cross_rank_inputs() -> None:
    result = simulate(build("gpipe", 2, 1), StageCosts.of(2, forward=1.0, backward=1.0, transfer=0.25))
    # F on rank 0 [0,1]; arrives 1.25; F on rank 1 [1.25, 2.25]; B [2.25, 3.25]; gradient arrives 3.5; B [3.5, 4.5].
    assert result.step_time == 4.5


def test_uneven_stages_and_activation_bytes() -> None:
    costs = StageCosts.of(3, forward=[1.0, 3.0, 1.0], backward=[2.0, 6.0, 2.0], activation_bytes=[100.0, 50.0, 10.0])
    result = simulate(build("1f1b", 3, 6), costs)
    assert result.peak_in_flight == (3, 2, 1)
    assert result.peak_activation_bytes == (300.0, 100.0, 10.0)
    # The slow middle stage is the bottleneck: it is never idle between its first and last action.
    middle = [e for e in result.timeline if e.rank == 1]
    assert sum(e.end - e.start for e in middle) == 6 * 9.0


def test_split_backward_defaults() -> None:
    costs = StageCosts.of(2, forward=1.0, backward=4.0)
    assert costs.input_grad == (2.0, 2.0) and costs.weight_grad == (2.0, 2.0)
    costs = StageCosts.of(1, input_grad=1.5, weight_grad=0.5)
    assert costs.backward == (2.0,)
    assert StageCosts.of(2).backward == (2.0, 2.0)


def test_costs_take_numpy_numbers() -> None:
    costs = StageCosts.of(2, forward=np.float32(1.5), backward=np.float64(3.0), transfer=np.int64(1))
    assert costs.forward == (1.5, 1.5) and costs.input_grad == (1.5, 1.5) and costs.transfer == (1.0,)


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"forward": [1.0]}, r"forward has 1 entries for 2 stages"),
        ({"backward": -1.0}, r"backward must be >= 0 for every stage, got \[-1.0, -1.0\]"),
        ({"forward": float("nan")}, r"forward must be >= 0"),
        ({"transfer": [1.0, 2.0]}, r"transfer has 2 entries for 1 boundaries between stages \(one fewer than the "),
        ({"transfer": [-1.0]}, r"transfer must be >= 0 for every boundary, got \[-1.0\]"),
        ({"input_grad": 5.0, "backward": 2.0}, r"input_grad takes 5 on stage 0, more than the whole backward \(2\)"),
        ({"weight_grad": [1.0, 3.0]}, r"weight_grad takes 3 on stage 1, more than the whole backward \(2\)"),
        (
            {"backward": 2.0, "input_grad": 0.5, "weight_grad": 1.0},
            r"input_grad \(0.5\) \+ weight_grad \(1\) = 1.5 on stage 0, less than backward \(2\): .* give two of the",
        ),
    ],
)
def test_bad_costs(kwargs: dict[str, object], pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        StageCosts.of(2, **kwargs)  # type: ignore[arg-type]


def test_a_measured_split_that_costs_more_than_the_whole_backward_slows_zero_bubble() -> None:
    # Measured: I and W each walk the graph, so together they take 3 where B takes 2.
    split = StageCosts.of(2, forward=1.0, backward=2.0, input_grad=1.5, weight_grad=1.5)
    assert (split.backward, split.input_grad, split.weight_grad) == ((2.0, 2.0), (1.5, 1.5), (1.5, 1.5))
    exact = StageCosts.of(2, forward=1.0, input_grad=1.0, weight_grad=1.0)
    schedule = build("zero-bubble", 2, 4)
    assert simulate(schedule, split).step_time > simulate(schedule, exact).step_time
    assert simulate(build("1f1b", 2, 4), split).step_time == simulate(build("1f1b", 2, 4), exact).step_time


def test_costs_must_match_the_schedule() -> None:
    with pytest.raises(ValueError, match=r"costs are for 3 stages but the schedule has 2"):
        simulate(build("1f1b", 2, 2), StageCosts.of(3))


def test_simulate_validates_first() -> None:
    with pytest.raises(ValueError, match=r"has no backward"):
        simulate(Schedule.from_text("rank 0: 0F0"), StageCosts.of(1))
