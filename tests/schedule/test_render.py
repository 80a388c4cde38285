"""Schedule pictures and Chrome traces."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from stagewise.schedule import StageCosts, build, render, simulate, to_chrome_trace


def timeline() -> tuple:  # type: ignore[type-arg]
    return simulate(build("zero-bubble", 3, 4), StageCosts.of(3, input_grad=1.0, weight_grad=1.0)).timeline


@pytest.mark.parametrize("suffix", [".png", ".svg"])
def test_render_writes_a_picture(tmp_path: Path, suffix: str) -> None:
    out = render(timeline(), tmp_path / f"zb{suffix}", title="zero-bubble")
    data = out.read_bytes()
    assert data.startswith(b"\x89PNG") if suffix == ".png" else b"<svg" in data[:2000]
    assert len(data) > 5000


def test_render_draws_one_ranks_executed_events_and_instant_actions(tmp_path: Path) -> None:
    # A rank's own events (a StepResult's events) hold one rank of several stages: each stage shades by its
    # place among that rank's stages, not by a rank count read off the events (which gave a negative alpha).
    interleaved = simulate(build("interleaved-1f1b", 16, 4, n_virtual=4), StageCosts.of(16)).timeline
    rank0 = [e for e in interleaved if e.rank == 0]
    assert render(rank0, tmp_path / "rank0.png").stat().st_size > 5000
    rank3 = [e for e in interleaved if e.rank == 3]
    assert render(rank3, tmp_path / "rank3.png").stat().st_size > 5000
    instant = simulate(build("1f1b", 2, 2), StageCosts.of(2, forward=0.0, backward=0.0)).timeline
    assert render(instant, tmp_path / "instant.png").stat().st_size > 1000


def test_render_refuses_an_empty_timeline(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"the timeline is empty"):
        render((), tmp_path / "x.png")


def test_chrome_trace(tmp_path: Path) -> None:
    events = timeline()
    out = to_chrome_trace(events, tmp_path / "trace.json", time_unit=1.0)
    trace = json.loads(out.read_text())["traceEvents"]
    spans = [e for e in trace if e["ph"] == "X"]
    names = [e for e in trace if e["ph"] == "M"]
    assert len(spans) == len(events) == 3 * 3 * 4
    assert {e["args"]["name"] for e in names} == {"rank 0", "rank 1", "rank 2"}
    first = spans[0]
    assert first["name"] == str(events[0].action) and first["ts"] == events[0].start and first["tid"] == events[0].rank
    with pytest.raises(ValueError, match=r"time_unit must be positive"):
        to_chrome_trace(events, tmp_path / "t.json", time_unit=0)
