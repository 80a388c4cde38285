"""Built schedules: all validate, and their simulated bubble and memory match the theory."""

from __future__ import annotations

from fractions import Fraction
from typing import get_args

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from stagewise.schedule import Kind, ScheduleName, SimulationResult, StageCosts, build, simulate, validate
from stagewise.schedule.builders import BUILDERS

ranks = st.integers(1, 8)
microbatches = st.integers(1, 32)


def exact_bubble(result: SimulationResult, n_ranks: int) -> Fraction:
    # Unit costs make every time an integer (or a multiple of 1/v), so these float sums are exact.
    return 1 - Fraction(sum(result.busy)) / (n_ranks * Fraction(result.step_time))


def unit(n_stages: int) -> StageCosts:
    return StageCosts.of(n_stages, forward=1.0, backward=2.0)


def split_unit(n_stages: int) -> StageCosts:
    return StageCosts.of(n_stages, forward=1.0, input_grad=1.0, weight_grad=1.0)


@settings(max_examples=60, deadline=None)
@given(ranks, microbatches, st.sampled_from(["gpipe", "1f1b", "zero-bubble"]))
def test_every_built_schedule_validates(p: int, m: int, name: str) -> None:
    schedule = build(name, p, m)  # type: ignore[arg-type]
    report = validate(schedule)
    assert len(report.peak_in_flight) == p
    actions = [a for r in schedule.ranks for a in r]
    per_mb = 3 if name == "zero-bubble" else 2
    assert len(actions) == len(set(actions)) == per_mb * p * m


@settings(max_examples=60, deadline=None)
@given(ranks, st.integers(1, 8), st.integers(2, 4))
def test_interleaved_validates(p: int, groups: int, v: int) -> None:
    m = p * groups
    schedule = build("interleaved-1f1b", p * v, m, n_virtual=v)
    assert schedule.n_ranks == p and schedule.n_virtual == v
    assert all(s % p == r for r, actions in enumerate(schedule.ranks) for s in {a.stage for a in actions})
    validate(schedule)


@settings(max_examples=60, deadline=None)
@given(ranks, microbatches)
def test_gpipe_and_1f1b_bubble_is_exactly_the_textbook_value(p: int, m: int) -> None:
    for name in ("gpipe", "1f1b"):
        result = simulate(build(name, p, m), unit(p))  # type: ignore[arg-type]
        assert exact_bubble(result, p) == Fraction(p - 1, m + p - 1)


@settings(max_examples=60, deadline=None)
@given(ranks, microbatches)
def test_peak_in_flight(p: int, m: int) -> None:
    assert simulate(build("1f1b", p, m), unit(p)).peak_in_flight == tuple(min(p - s, m) for s in range(p))
    assert simulate(build("gpipe", p, m), unit(p)).peak_in_flight == (m,) * p


@settings(max_examples=60, deadline=None)
@given(st.integers(2, 8), st.integers(1, 8), st.integers(2, 4))
def test_interleaved_bubble_is_smaller_than_1f1b(p: int, groups: int, v: int) -> None:
    m = p * groups
    # The same work per rank: each of a rank's v stages costs 1/v of its single stage.
    interleaved = simulate(
        build("interleaved-1f1b", p * v, m, n_virtual=v), StageCosts.of(p * v, forward=1 / v, backward=2 / v)
    )
    plain = simulate(build("1f1b", p, m), unit(p))
    assert interleaved.bubble < plain.bubble


@settings(max_examples=60, deadline=None)
@given(st.integers(2, 8), microbatches)
def test_zero_bubble_beats_1f1b_holding_micro_batches_until_their_weight_pass(p: int, m: int) -> None:
    zb = simulate(build("zero-bubble", p, m), split_unit(p))
    plain = simulate(build("1f1b", p, m), unit(p))
    assert zb.bubble < plain.bubble
    # The input pass keeps each micro-batch's graph for its weight pass, deferred by up to p - 1 more.
    assert zb.peak_in_flight == tuple(min(2 * p - 1 - s, m) for s in range(p))


def test_zero_bubble_reaches_a_third_of_1f1b_bubble() -> None:
    # ZB-H1's headline (Qi et al. 2023): with F = I = W, the bubble is a third of 1F1B's.
    zb = simulate(build("zero-bubble", 4, 8), split_unit(4))
    plain = simulate(build("1f1b", 4, 8), unit(4))
    idle_zb = zb.step_time * 4 - sum(zb.busy)
    idle_plain = plain.step_time * 4 - sum(plain.busy)
    assert idle_zb * 3 == idle_plain


def test_single_rank_has_no_bubble() -> None:
    for name in ("gpipe", "1f1b", "zero-bubble"):
        assert simulate(build(name, 1, 4), split_unit(1)).bubble == 0.0  # type: ignore[arg-type]


def test_zero_bubble_splits_backward() -> None:
    schedule = build("zero-bubble", 2, 3)
    kinds = {a.kind for r in schedule.ranks for a in r}
    assert kinds == {Kind.F, Kind.I, Kind.W} and schedule.splits_backward


@pytest.mark.parametrize(
    ("args", "kwargs", "error", "pattern"),
    [
        (("pipedream", 2, 2), {}, ValueError, r"unknown schedule 'pipedream'; choose one of \['gpipe', '1f1b'"),
        (("1f1b", 0, 2), {}, ValueError, r"n_stages must be >= 1, got 0"),
        (("1f1b", 2, 0), {}, ValueError, r"n_microbatches must be >= 1, got 0"),
        (("1f1b", 2.0, 2), {}, TypeError, r"n_stages must be an int, got float"),
        (("1f1b", 4, 8), {"n_virtual": 2}, ValueError, r"1f1b runs one stage per rank; got n_virtual=2"),
        (("interleaved-1f1b", 4, 8), {}, ValueError, r"needs n_virtual >= 2 stages per rank, got 1"),
        (("zbv", 6, 8), {"n_virtual": 3}, ValueError, r"zbv holds exactly 2 stages per rank, got n_virtual=3; give it"),
        (("interleaved-1f1b", 6, 8), {"n_virtual": 4}, ValueError, r"n_stages=6 is not a multiple of n_virtual=4"),
        (
            ("interleaved-1f1b", 8, 6),
            {"n_virtual": 2},
            ValueError,
            r"multiple of the number of ranks \(4 = 8 stages / 2 per rank\), got 6; try 8",
        ),
    ],
)
def test_schedules_that_do_not_fit(
    args: tuple[object, ...], kwargs: dict[str, int], error: type[Exception], pattern: str
) -> None:
    with pytest.raises(error, match=pattern):
        build(*args, **kwargs)  # type: ignore[arg-type]


@settings(max_examples=30, deadline=None)
@given(ranks, microbatches, st.sampled_from(["gpipe", "1f1b", "zero-bubble"]))
def test_transfer_time_only_lengthens_the_step(p: int, m: int, name: str) -> None:
    assume(p > 1)
    schedule = build(name, p, m)  # type: ignore[arg-type]
    fast = simulate(schedule, split_unit(p))
    slow = simulate(schedule, StageCosts.of(p, forward=1.0, input_grad=1.0, weight_grad=1.0, transfer=0.5))
    assert slow.step_time >= fast.step_time + 2 * 0.5 * (p - 1) - 1e-9


@settings(max_examples=60, deadline=None)
@given(ranks, microbatches, st.integers(2, 4))
def test_looped_bfs_holds_every_micro_batch_on_every_stage_for_the_looped_gpipe_bubble(p: int, m: int, v: int) -> None:
    schedule = build("looped-bfs", p * v, m, n_virtual=v)
    validate(schedule)
    assert schedule.round_robin and schedule.n_virtual == v
    result = simulate(schedule, unit(p * v))
    assert result.peak_in_flight == (m,) * (p * v)
    if m >= p:  # the whole round of p micro-batches fills the loop: GPipe's bubble over v times the work
        assert exact_bubble(result, p) == Fraction(p - 1, v * m + p - 1)


def v_held(name: str, p: int, m: int) -> tuple[list[int], Fraction]:
    """A V-shaped schedule built, validated and simulated with F = I = W = 1 on each of its 2p half-size stages:
    the half-stages in flight on each rank at its fullest, and its bubble, which is below 1F1B's for p > 1."""
    schedule = build(name, 2 * p, m, n_virtual=2)  # type: ignore[arg-type]
    validate(schedule)
    assert schedule.placement == (*range(p), *reversed(range(p))) and schedule.splits_backward
    result = simulate(schedule, split_unit(2 * p))
    bubble = exact_bubble(result, p)
    if p > 1:  # 1F1B's whole stages: F = 2, B = 4
        assert bubble < exact_bubble(simulate(build("1f1b", p, m), StageCosts.of(p, forward=2.0, backward=4.0)), p)
    return [result.peak_in_flight[r] + result.peak_in_flight[2 * p - 1 - r] for r in range(p)], bubble


@settings(max_examples=80, deadline=None)
@given(ranks, microbatches)
def test_zbv_places_a_v_holds_at_most_one_more_than_1f1bs_first_rank_and_idles_less(p: int, m: int) -> None:
    held, _ = v_held("zbv", p, m)
    # 1F1B's first rank holds min(p, m) whole stages, 2 min(p, m) half ones: ZBV's holds at most one more.
    assert held[0] == min(m, 2 * p) + 1 and max(held) == min(2 * m, 2 * p + 1)


@settings(max_examples=80, deadline=None)
@given(ranks, microbatches)
def test_dualpipev_places_a_v_holds_at_most_2p_and_idles_less_than_1f1b(p: int, m: int) -> None:
    if m < 2 * p:
        with pytest.raises(ValueError, match=rf"^dualpipev needs at least 2 x the ranks = {2 * p} micro-batches"):
            build("dualpipev", 2 * p, m, n_virtual=2)
        return
    held, _ = v_held("dualpipev", p, m)
    assert held == [2 * p + 1] * p  # on every rank, one more than 1F1B's first rank holds (2p half-stages)


def test_v_shaped_bubbles_at_four_ranks_and_eight_micro_batches() -> None:
    # F = I = W = 1 on each of 8 half-size stages (B = I + W = 2).
    dualpipev = simulate(build("dualpipev", 8, 8, n_virtual=2), split_unit(8))
    zbv = simulate(build("zbv", 8, 8, n_virtual=2), split_unit(8))
    assert exact_bubble(zbv, 4) == Fraction(1, 17)  # 1F1B's is 3/11, ZB-H1's (one stage per rank) 1/9
    assert exact_bubble(dualpipev, 4) == Fraction(1, 17)  # its F and B pairs one after the other, not overlapped


def test_every_schedule_name_has_its_builder() -> None:
    # One definition per schedule: the name list and the builders are the same set, in the same order.
    assert tuple(BUILDERS) == get_args(ScheduleName)
    for name, builder in BUILDERS.items():
        shape = (4, 4, 2) if builder.virtual else (2, 2, 1)  # stages, micro-batches, stages per rank
        schedule = build(name, shape[0], shape[1], n_virtual=shape[2])
        assert (schedule.name, schedule.n_virtual) == (name, shape[2])
        with pytest.raises(ValueError, match=r"needs n_virtual >= 2|runs one stage per rank|exactly 2 stages"):
            build(name, 4, 2, n_virtual=1 if builder.virtual else 2)
