"""What a finished training run shows: summary.json and loss.png in its folder (the whole run when it resumed one),
and the lines to print."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

from stagewise.run import Summary


def _strict(value: Any) -> Any:
    """``value`` with NaN and infinities as None: JSON has no words for them (a skipped step's loss)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _strict(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_strict(v) for v in value]
    return value


def _whole_run(summary: Summary, out: Path) -> Summary:
    """``summary`` of a resumed run with the steps before it that ``out/summary.json`` recorded: the whole run."""
    try:
        earlier = json.loads((out / "summary.json").read_text())
    except (FileNotFoundError, ValueError):
        return summary
    keep = summary.first_step - earlier.get("first_step", 0)
    if summary.first_step == 0 or not 0 <= keep <= len(earlier.get("losses", [])):
        return summary
    nan = math.nan
    return dataclasses.replace(
        summary,
        first_step=earlier["first_step"],
        losses=[nan if v is None else v for v in earlier["losses"][:keep]] + summary.losses,
        step_seconds=earlier["step_seconds"][:keep] + summary.step_seconds,
        evals=[(s, v) for s, v in earlier["evals"] if s <= summary.first_step] + summary.evals,
        skipped=[s for s in earlier["skipped"] if s <= summary.first_step] + summary.skipped,
    )


def _unit(summary: Summary) -> str:
    return "tokens" if summary.tokens_per_sample > 1 else "samples"


def report(summary: Summary, out: Path) -> list[str]:
    """Write summary.json (and loss.png) into ``out``, for the whole run when this one resumed it; the lines to
    show."""
    out.mkdir(parents=True, exist_ok=True)
    resumed = summary.first_step
    summary = _whole_run(summary, out)
    data = dataclasses.asdict(summary) | {"tokens_per_second": summary.throughput()}
    (out / "summary.json").write_text(json.dumps(_strict(data), indent=1, allow_nan=False) + "\n")
    lines = [f"resumed from step {resumed}"] if resumed else []
    if summary.losses:
        lines.append(
            f"steps {summary.first_step + 1}..{summary.first_step + len(summary.losses)}: loss "
            f"{summary.losses[0]:.3f} -> {summary.losses[-1]:.3f}, {summary.throughput():.0f} {_unit(summary)}/s"
        )
    if summary.evals:
        step, last = summary.evals[-1]
        perplexity = f"{math.exp(last):.2f}" if last < 700 else "inf"
        lines.append(
            "validation loss " + ", ".join(f"{v:.3f} (step {s})" for s, v in summary.evals)
            + f"; perplexity {perplexity} at step {step}"
        )  # fmt: skip
    if summary.checkpoint:
        lines.append(f"checkpoint {summary.checkpoint}")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    steps = range(summary.first_step + 1, summary.first_step + len(summary.losses) + 1)
    ax.plot(list(steps), summary.losses, label="training", linewidth=1)
    if summary.evals:
        ax.plot(*zip(*summary.evals, strict=True), "o-", label="validation")
    ax.set(xlabel="step", ylabel="loss", title=f"{summary.config['model']}: {summary.parameters:,} parameters")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "loss.png", dpi=120)
    plt.close(fig)
    lines.append(f"wrote {out / 'summary.json'} and {out / 'loss.png'}")
    return lines
