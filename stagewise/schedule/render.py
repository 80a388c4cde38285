"""Pictures and traces of a timeline: a Gantt chart (matplotlib) and Chrome/Perfetto trace JSON."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from stagewise.schedule.actions import Kind
from stagewise.schedule.dependencies import Event
from stagewise.schedule.spans import Span

COLOURS = {Kind.F: "#4C72B0", Kind.B: "#55A868", Kind.I: "#8CC084", Kind.W: "#DD8452"}
"""Box colour of each action kind."""


def _pyplot() -> Any:
    import matplotlib  # imported here, not with the module: the schedule layer loads nothing heavy

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def render(timeline: Sequence[Event], path: str | Path, *, title: str | None = None) -> Path:
    """Draw ``timeline`` as a Gantt chart: one row per rank, a box per action labelled with its micro-batch.

    F, B, I and W have their own colours; on ranks with several stages
    (interleaved), later stages are drawn lighter. The format follows the
    suffix of ``path`` (``.png``, ``.svg``, ``.pdf``).
    """
    if not timeline:
        raise ValueError("the timeline is empty; simulate a schedule first")
    out = Path(path)
    plt = _pyplot()
    ranks = sorted({e.rank for e in timeline})  # all of a pipeline's, or the one whose executed events these are
    row = {r: i for i, r in enumerate(ranks)}
    stages = {r: sorted({e.action.stage for e in timeline if e.rank == r}) for r in ranks}
    end = max(e.end for e in timeline)
    fig, ax = plt.subplots(figsize=(max(6.0, min(24.0, 0.45 * end + 1.5)), 0.5 * len(ranks) + 1.2))
    thinnest = end / 250  # a box drawn any thinner is invisible: a cheap stage (an embedding) keeps its boxes
    for e in timeline:
        mine = stages[e.rank]
        width = max(e.end - e.start, thinnest)
        ax.broken_barh(
            [(e.start, width)],
            (row[e.rank] - 0.4, 0.8),
            facecolors=COLOURS[e.action.kind],
            edgecolors="white",
            alpha=1.0 - 0.45 * mine.index(e.action.stage) / len(mine),
        )
        if width < end / 80:  # no room for its label
            continue
        ax.text(
            e.start + width / 2,
            row[e.rank],
            str(e.action.microbatch),
            ha="center",
            va="center",
            fontsize=7,
            color="white",
        )
    ax.set_yticks(range(len(ranks)), [f"rank {r}" for r in ranks])
    ax.set_ylim(len(ranks) - 0.5, -0.5)
    ax.set_xlim(0, end if end > 0 else 1.0)
    ax.set_xlabel("time")
    kinds = sorted({e.action.kind for e in timeline}, key=lambda k: "FBIW".index(k.value))
    names = {Kind.F: "forward", Kind.B: "backward", Kind.I: "input grad", Kind.W: "weight grad"}
    ax.legend(
        handles=[plt.Rectangle((0, 0), 1, 1, color=COLOURS[k]) for k in kinds],
        labels=[names[k] for k in kinds],
        loc="upper left",
        bbox_to_anchor=(1.0, 1.0),
        fontsize=8,
        frameon=False,
    )
    if title:
        ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def to_chrome_trace(
    timeline: Sequence[Event], path: str | Path, *, time_unit: float = 1e-6, spans: Sequence[Span] = ()
) -> Path:
    """Write ``timeline`` (and ``spans``, e.g. waits) as Chrome trace JSON: one thread per rank.

    Open it in chrome://tracing or ui.perfetto.dev. Times are divided by
    ``time_unit`` to get the trace's microseconds; the default treats them as
    seconds. Simulated timelines and executed ones (``Pipeline(trace=...)``)
    share this format.
    """
    if time_unit <= 0:
        raise ValueError(f"time_unit must be positive, got {time_unit}")
    events: list[dict[str, Any]] = [
        {"name": "thread_name", "ph": "M", "pid": 0, "tid": r, "args": {"name": f"rank {r}"}}
        for r in sorted({e.rank for e in timeline} | {s.rank for s in spans})
    ]
    for e in timeline:
        events.append(
            {
                "name": str(e.action),
                "cat": e.action.kind.value,
                "ph": "X",
                "pid": 0,
                "tid": e.rank,
                "ts": e.start / time_unit,
                "dur": (e.end - e.start) / time_unit,
                "args": {"stage": e.action.stage, "microbatch": e.action.microbatch, "kind": e.action.kind.value},
            }
        )
    for span in spans:
        events.append(
            {
                "name": span.name,
                "cat": span.category,
                "ph": "X",
                "pid": 0,
                "tid": span.rank,
                "ts": span.start / time_unit,
                "dur": (span.end - span.start) / time_unit,
            }
        )
    out = Path(path)
    out.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
    return out
