"""CheckpointError: a checkpoint that cannot be used, or a save that failed, with the reason and the fix."""

from __future__ import annotations

from stagewise.errors import StagewiseError


class CheckpointError(StagewiseError, ValueError):
    """A checkpoint that cannot be used (missing, incomplete, corrupt, unsafe, from a different model), or a save
    that failed (the partial folder is removed; the previous checkpoint stays the latest)."""


def reason(err: BaseException) -> str:
    """The first underlying failure of an error (DCP gathers each rank's into one), in one line."""
    failures = getattr(err, "failures", None)
    inner: object = next(iter(failures.values())) if isinstance(failures, dict) and failures else err
    inner = inner[0] if isinstance(inner, tuple) and inner else getattr(inner, "exception", inner)
    text = str(inner).strip().splitlines()
    return f"{type(inner).__name__}{': ' + text[0] if text else ''}"
