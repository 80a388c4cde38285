"""validate(): broken schedules are refused, each with a message naming the action and the rule."""

from __future__ import annotations

import pytest

from stagewise.schedule import Schedule, ScheduleError, build, validate


def schedule(*lines: str) -> Schedule:
    return Schedule.from_text("\n".join(f"rank {r}: {line}" for r, line in enumerate(lines)))


def test_a_valid_hand_written_schedule() -> None:
    report = validate(schedule("0F0 0F1 0B0 0B1", "1F0 1B0 1F1 1B1"))
    assert report.peak_in_flight == (2, 1)
    assert report.messages == 4


@pytest.mark.parametrize(
    ("lines", "pattern"),
    [
        (("0F0 0F1 0B0", "1F0 1B0 1F1 1B1"), r"stage 0, micro-batch 1 has no backward \(B, or I then W\)"),
        (("0F0 0B0", "1B0"), r"stage 1, micro-batch 0 has no forward: add 1F0"),
        (
            ("0F0 2F0 2B0 0B0", "1F0 1B0"),  # three stages on two ranks: the count rounds up to four
            r"stage 3 has no actions at all; a schedule on 2 ranks has a multiple of 2 stages \(each rank holds as "
            r"many\), here 4: give stage 3 its forwards and backwards on rank 1, or use stages 0 .. 2 on a "
            r"number of ranks that divides 3",
        ),
        (
            ("2F0 2B0", "1F0 3F0 3B0 1B0"),
            r"stage 0 has no actions at all; .*: give stage 0 its forwards and backwards "
            r"on rank 0$",
        ),
        (("0F0 0F0 0B0", "1F0 1B0"), r"stage 0, micro-batch 0 has 2 F actions \(rank 0 action 0, rank 0 action 1\)"),
        (("0F0 0I0", "1F0 1B0"), r"stage 0, micro-batch 0 has 0I0 but no W: its weight gradient is never computed"),
        (("0F0 0B0 0W0", "1F0 1B0"), r"has a W after a full backward B"),
        (("0F0 0B0 0I0 0W0", "1F0 1B0"), r"has both a full backward B and a split one I"),
        (
            ("0F0 0W0 0I0", "1F0 1B0"),
            r"rank 0, action 1 \(0W0\) runs before 0I0 \(action 2\), which it needs: W comes after its I",
        ),
        (
            ("0B0 0F0", "1F0 1B0"),
            r"rank 0, action 0 \(0B0\) runs before 0F0 \(action 1\), which it needs: a backward needs its own forward",
        ),
    ],
)
def test_broken_schedules(lines: tuple[str, ...], pattern: str) -> None:
    with pytest.raises(ScheduleError, match=pattern):
        validate(schedule(*lines))


def test_a_cyclic_wait_between_two_ranks_is_a_named_deadlock() -> None:
    # Rank 0 waits for micro-batch 0's gradient before it sends micro-batch 1's activation,
    # and rank 1 waits for that activation before it sends the gradient.
    broken = schedule("0F0 0B0 0F1 0B1", "1F0 1F1 1B0 1B1")
    with pytest.raises(ScheduleError) as info:
        validate(broken)
    message = str(info.value)
    assert message.startswith("deadlock: the ranks wait on each other in a cycle")
    assert "rank 0 waits in action 1 (0B0) for 1B0 (rank 1)" in message
    assert "rank 1 waits in action 1 (1F1) for 0F1 (rank 0)" in message


def test_messages_out_of_order_between_two_ranks() -> None:
    # Rank 1 wants micro-batch 1's activation first; rank 0 sends micro-batch 0's first.
    broken = schedule("0F0 0F1 0B0 0B1", "1F1 1F0 1B0 1B1")
    with pytest.raises(
        ScheduleError,
        match=r"rank 1 receives the activations from rank 0 out of order: message 0 sent is the activation 0->1 of "
        r"micro-batch 0, but rank 1 expects the activation 0->1 of micro-batch 1",
    ):
        validate(broken)


def test_interleaved_on_one_rank_checks_local_order() -> None:
    one_rank = Schedule.from_text("rank 0: 1F0 0F0 1B0 0B0")
    with pytest.raises(
        ScheduleError,
        match=r"rank 0, action 0 \(1F0\) runs before 0F0 \(action 1\), which it needs: "
        r"a forward needs the previous stage's forward",
    ):
        validate(one_rank)


def test_validate_reports_gpipe_memory() -> None:
    assert validate(build("gpipe", 3, 5)).peak_in_flight == (5, 5, 5)
