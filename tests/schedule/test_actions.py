"""Actions and schedules as data: the text form, and the invariants a Schedule keeps."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stagewise.schedule import Action, Kind, Schedule, build


def test_action_text() -> None:
    assert str(Action(0, Kind.F, 3)) == "0F3"
    assert Action.parse("12W7") == Action(12, Kind.W, 7)
    assert Kind.B.is_backward and Kind.I.is_backward and not Kind.W.is_backward


@pytest.mark.parametrize("token", ["F3", "0X3", "0F", "a0F3", "0 F 3", ""])
def test_bad_action_text(token: str) -> None:
    with pytest.raises(ValueError, match=r"cannot read action .*; write stage, kind, micro-batch, e.g. 0F3"):
        Action.parse(token)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 6), st.integers(1, 12), st.sampled_from(["gpipe", "1f1b", "zero-bubble"]))
def test_text_round_trip(p: int, m: int, name: str) -> None:
    schedule = build(name, p, m)  # type: ignore[arg-type]
    again = Schedule.from_text(schedule.to_text(), name=name)
    assert again == schedule


def test_load_from_file(tmp_path: Path) -> None:
    path = tmp_path / "mine.txt"
    path.write_text("# two ranks\nrank 0: 0F0 0B0  # comment\n\nrank 1: 1F0 1B0\n")
    schedule = Schedule.load(path)
    assert schedule.name == "mine" and schedule.n_stages == 2 and schedule.n_microbatches == 1
    assert schedule.ranks[1] == (Action(1, Kind.F, 0), Action(1, Kind.B, 0))


@pytest.mark.parametrize(
    ("text", "pattern"),
    [
        ("", r"has no actions"),
        ("0F0 0B0", r"line 1: expected 'rank N: 0F0 0B0 ...'"),
        ("rank 1: 0F0", r"line 1: expected rank 0 next, got rank 1"),
        ("rank 0: 0F0 0Q0", r"line 1: cannot read action '0Q0'"),
        ("rank 0: 0F0\nrank 1: 0B0", r"rank 1, action 0 \(0B0\) belongs to rank 0, which holds stage 0 \(placement"),
    ],
)
def test_bad_schedule_text(text: str, pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        Schedule.from_text(text)


def test_schedule_invariants() -> None:
    with pytest.raises(ValueError, match=r"3 stages cannot be spread over 2 ranks"):
        Schedule("x", 3, 1, ((), ()))
    with pytest.raises(ValueError, match=r"rank 0, action 0 \(0F5\) is outside 2 stages x 2 micro-batches"):
        Schedule("x", 2, 2, ((Action(0, Kind.F, 5),), ()))
    with pytest.raises(ValueError, match=r"at least one rank"):
        Schedule("x", 1, 1, ())


def test_interleaved_placement() -> None:
    schedule = build("interleaved-1f1b", 6, 4, n_virtual=3)
    assert schedule.n_ranks == 2 and list(schedule.stages_of(1)) == [1, 3, 5]
    assert schedule.rank_of(4) == 0


def test_a_placement_is_data_and_a_v_is_read_back_from_text() -> None:
    ranks = ((Action(0, Kind.F, 0), Action(3, Kind.F, 0)), (Action(1, Kind.F, 0), Action(2, Kind.F, 0)))
    v = Schedule("v", 4, 1, ranks, placement=(0, 1, 1, 0))
    assert v.stages_of(0) == (0, 3) and v.stages_of(1) == (1, 2) and v.rank_of(3) == 0 and not v.round_robin
    again = Schedule.from_text(v.to_text())
    assert again.placement == (0, 1, 1, 0) and again.ranks == v.ranks
    assert build("interleaved-1f1b", 4, 2, n_virtual=2).round_robin
    by_hand = Schedule("v", 4, 1, ranks, placement=[0, 1, 1, 0])  # type: ignore[arg-type]
    assert by_hand.placement == (0, 1, 1, 0) and by_hand == v


@pytest.mark.parametrize(
    ("placement", "pattern"),
    [
        ((0, 1, 1, 1), r"placement \[0, 1, 1, 1\] gives the ranks \[1, 3\] stages; each must hold 2 \(4 stages on 2"),
        ((0, 1, 2, 0), r"placement \[0, 1, 2, 0\] must give each of the 4 stages a rank in 0 \.\. 1"),
        ((0, 1), r"placement \[0, 1\] must give each of the 4 stages a rank"),
    ],
)
def test_a_placement_that_is_not_one_rank_per_stage_evenly_is_refused(placement: tuple[int, ...], pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        Schedule("x", 4, 1, ((), ()), placement=placement)
