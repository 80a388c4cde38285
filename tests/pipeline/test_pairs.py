"""Which actions run at once (a forward and the whole backward after it, of another stage that exchanges tokens),
and running them: both results, or the error of either."""

from __future__ import annotations

import threading

import pytest

from stagewise.pipeline.execution.pairs import overlapped_pairs, run_together
from stagewise.schedule import build
from stagewise.schedule.actions import Kind


def test_dualpipev_pairs_each_forward_with_the_backward_after_it_in_its_steady_state() -> None:
    schedule = build("dualpipev", n_stages=4, n_microbatches=8, n_virtual=2)
    actions = schedule.ranks[1]  # stages 1 and 2
    pairs = overlapped_pairs(actions, exchanging={1, 2}, excluded=set(), recomputing=set())
    assert pairs, "DualPipeV's steady state has forwards followed by backwards of the other stage"
    for i in pairs:
        f, b = actions[i], actions[i + 1]
        assert f.kind is Kind.F and b.kind is Kind.B and f.stage != b.stage
    assert all(j - i >= 2 for i, j in zip(sorted(pairs), sorted(pairs)[1:], strict=False)), "an action in two pairs"
    # A stage that exchanges nothing on either side, a synchronising backward, a recomputing one: no pair.
    assert overlapped_pairs(actions, exchanging=set(), excluded=set(), recomputing=set()) == set()
    first = min(pairs)
    assert first not in overlapped_pairs(actions, exchanging={1, 2}, excluded={first + 1}, recomputing=set())
    stage_b = actions[first + 1].stage
    kept = overlapped_pairs(actions, exchanging={1, 2}, excluded=set(), recomputing={stage_b})
    assert all(actions[i + 1].stage != stage_b for i in kept)


def test_1f1b_has_no_pair_a_rank_holds_one_stage() -> None:
    for actions in build("1f1b", n_stages=2, n_microbatches=4).ranks:
        assert overlapped_pairs(actions, exchanging={0, 1}, excluded=set(), recomputing=set()) == set()


def test_run_together_runs_both_at_once_and_raises_either_error() -> None:
    both = threading.Barrier(2, timeout=10)  # each waits for the other: only at once do both return

    def here() -> str:
        both.wait()
        return "here"

    def beside() -> str:
        both.wait()
        return "beside"

    assert run_together(here, beside) == ("here", "beside")

    def failing() -> str:
        raise ValueError("beside failed")

    with pytest.raises(ValueError, match="beside failed"):
        run_together(lambda: "here", failing)
    with pytest.raises(KeyError):
        run_together(lambda: {}["missing"], lambda: "beside")
