"""Faults planted in a training rank: a callback run in its forward, backward, optimizer step or checkpoint save."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch.optim.optimizer import register_optimizer_step_pre_hook

from stagewise.checkpoint import saving
from stagewise.pipeline import Pipeline

PHASES = ("forward", "backward", "optimizer", "save", "seal")
"""Where a fault can strike: a layer's forward or backward, the optimizer step, DCP's write of a save, or rank 0's
sealing of its manifest (every rank's part written, the rename not yet done)."""


def arm(pipe: Pipeline, phase: str, step: int, microbatches: int, fault: Callable[[], None]) -> None:
    """Call ``fault()`` once, in ``phase`` of step ``step`` (counted from 1) of this rank's training with ``pipe``.

    Once: a process stopped by the fault (SIGSTOP) and woken again must not stop itself again at its next
    micro-batch."""
    calls = {"forward": 0, "backward": 0}
    layer = next(iter(pipe.stages.values())).layers[0]
    fired: list[bool] = []

    def once() -> None:
        if not fired:
            fired.append(True)
            fault()

    def count(kind: str) -> None:
        calls[kind] += 1
        if kind == phase and calls[kind] > (step - 1) * microbatches:
            once()

    layer.register_forward_pre_hook(lambda *_: count("forward"))
    layer.register_full_backward_pre_hook(lambda *_: count("backward"))
    if phase == "optimizer":
        steps = [0]

        def before_step(*_: Any) -> None:
            steps[0] += 1
            if steps[0] == step:
                once()

        register_optimizer_step_pre_hook(before_step)
    if phase == "save":
        write = saving.dcp_save

        def writing(*args: Any, **kwargs: Any) -> Any:
            if pipe.steps == step:
                once()
            return write(*args, **kwargs)

        saving.dcp_save = writing  # type: ignore[assignment]
    if phase == "seal":
        seal = saving.seal

        def sealing(*args: Any, **kwargs: Any) -> None:
            if pipe.steps == step:
                once()
            seal(*args, **kwargs)

        saving.seal = sealing  # type: ignore[assignment]
