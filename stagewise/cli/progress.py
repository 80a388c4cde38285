"""What rank 0 of ``stagewise train`` shows as the run goes: a progress bar on a terminal, a line every N steps
in a log file."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from stagewise.pipeline import Pipeline
    from stagewise.run import TrainConfig


class Progress:
    """What rank 0 shows as the run goes: a progress bar on a terminal; in a log file (SLURM's, CI's), where a
    bar's redraws would pile up, one line every ``config.log_every`` steps."""

    def __init__(self, config: TrainConfig) -> None:
        self.config = config
        self.bar: Any = None
        self.unit = "tok/s" if config.tokens_per_sample > 1 else "samples/s"

    def started(self, pipe: Pipeline) -> None:
        print(pipe.mesh.describe(), flush=True)
        print(f"partition {list(pipe.partition.bounds)}, schedule {pipe.schedule.name}", flush=True)
        if sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=self.config.steps, desc="train", unit="step", dynamic_ncols=True)

    def stepped(self, step: int, loss: float, seconds: float) -> None:
        rate = self.config.batch_size * self.config.tokens_per_sample / max(seconds, 1e-9)
        if self.bar is not None:
            self.bar.update(step - self.bar.n)  # a resumed run starts at its step
            self.bar.set_postfix(
                loss=f"{loss:.3f}", **{self.unit.replace("/", "_"): f"{rate:.0f}"}, step_s=f"{seconds:.2f}"
            )
        elif step % self.config.log_every == 0 or step == self.config.steps:
            print(
                f"step {step}/{self.config.steps}: loss {loss:.3f}, {rate:.0f} {self.unit}, {seconds:.2f} s/step",
                flush=True,
            )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
