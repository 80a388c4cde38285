"""``stagewise train``: the main job, on local processes by default, or as one rank of a torchrun job."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import os
import sys
from pathlib import Path
from typing import Any, get_args

import torch

from stagewise import checkpoint
from stagewise.cli import args
from stagewise.comm import Layout, launch
from stagewise.models import PRESETS, GPTConfig, preset
from stagewise.pipeline import Pipeline
from stagewise.plan import load_plan
from stagewise.run import Optimizer, Summary, TrainConfig, preflight, train
from stagewise.run.resume import fresh_run_refused
from stagewise.schedule import ScheduleName

DEFAULTS = TrainConfig()
PLANNED = (
    "model", "stages", "dp", "virtual", "schedule", "microbatches", "batch_size", "activation_checkpointing",
    "seq_len", "optimizer",
)  # fmt: skip
"""The settings a --plan makes; their flags default to None (given: a value, even the default's)."""


def add(commands: Any) -> None:
    p = commands.add_parser(
        "train",
        help="train a preset model with a pipeline (the main job)",
        description="Train a preset model split into pipeline stages. Without torchrun it starts "
        "stages x dp local processes itself (gloo on the CPU, NCCL when there is a GPU per process); "
        "under torchrun each process is one rank, so several nodes are plain torchrun.",
    )
    d = DEFAULTS
    # The layout's flags default to None, so that a --plan can tell a flag given (even as the default) from none.
    p.add_argument("--model", choices=sorted(PRESETS), help=f"model preset (default {d.model})")
    p.add_argument("--stages", type=args.positive_int, help=f"pipeline ranks (default {d.stages})")
    p.add_argument("--virtual", type=args.positive_int, help=f"stages per rank, interleaved (default {d.virtual})")
    p.add_argument("--dp", type=args.positive_int, help=f"data-parallel replicas of the pipeline (default {d.dp})")
    p.add_argument("--schedule", choices=get_args(ScheduleName), help=f"pipeline schedule (default {d.schedule})")
    p.add_argument("--microbatches", type=args.positive_int, help=f"micro-batches per step (default {d.microbatches})")
    p.add_argument("--batch-size", type=args.positive_int, help=f"global batch, samples (default {d.batch_size})")
    p.add_argument(
        "--seq-len", type=args.positive_int, default=None, help=f"tokens per sequence (GPT; default {d.seq_len})"
    )
    p.add_argument("--steps", type=args.positive_int, default=d.steps, help="optimizer steps (the schedule's length)")
    p.add_argument("--stop-after", type=args.positive_int, default=None, help="end after this step (resume later)")
    p.add_argument("--lr", type=float, default=d.lr, help="peak learning rate (warm-up, then cosine to lr/10)")
    p.add_argument("--warmup", type=int, default=d.warmup, help="warm-up steps")
    p.add_argument("--optimizer", choices=get_args(Optimizer), help=f"optimizer (default {d.optimizer})")
    p.add_argument("--clip", type=float, default=d.clip, help="gradient norm clip (0: off)")
    p.add_argument("--bf16", action="store_true", help="bfloat16 autocast in the forward")
    p.add_argument(
        "--activation-checkpointing", action="store_true", default=None, help="recompute activations in backward"
    )
    p.add_argument(
        "--weight-grad-pool", dest="weight_gradient_pool", type=args.pool, default="free", metavar="K",
        help="pool K backwards' weight gradients into one GEMM per weight, or 'free' (the default): as many as "
        "fit in the pipeline's peak of micro-batches in flight (a whole step for gpipe, r + 1 on rank r for 1f1b; "
        "zero-bubble and activation checkpointing never pool)",
    )  # fmt: skip
    p.add_argument(
        "--no-weight-grad-fusion", dest="weight_gradient_fusion", action="store_false",
        help="leave weight-gradient accumulation to autograd (default: large linear weights accumulate in backward)",
    )  # fmt: skip
    p.add_argument("--seed", type=int, default=d.seed, help="seed of the weights and the data order")
    p.add_argument("--data", default=d.data, help="text file or folder (GPT; default: the Python stdlib source)")
    p.add_argument(
        "--data-limit", type=args.size, default=None, metavar="SIZE",
        help="read at most this much of the text, e.g. 64MiB (default: all of --data, 8 MiB of the stdlib source)",
    )  # fmt: skip
    p.add_argument("--eval-every", type=int, default=d.eval_every, help="validate every N steps (0: at the end)")
    p.add_argument("--eval-batches", type=args.positive_int, default=d.eval_batches, help="validation batches")
    p.add_argument("--checkpoint-dir", default="stagewise-run/checkpoints", help="write checkpoints here")
    p.add_argument("--no-checkpoints", dest="checkpoint_dir", action="store_const", const=None, help="write none")
    p.add_argument("--checkpoint-every", type=int, default=d.checkpoint_every, help="save every N steps (0: at end)")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --checkpoint-dir")
    p.add_argument("--trace", default=d.trace, help="write a Chrome trace of the last step here (per rank)")
    p.add_argument(
        "--skip-nonfinite", dest="nonfinite", action="store_const", const="skip", default="raise",
        help="skip a step whose loss is NaN or infinite (default: stop with an error naming it)",
    )  # fmt: skip
    p.add_argument("--timeout", type=float, default=d.timeout, help="seconds a rank waits for another")
    p.add_argument(
        "--max-restarts", type=int, default=0,
        help="restart all local processes this often after a failure, resuming from the latest checkpoint",
    )  # fmt: skip
    p.add_argument(
        "--pin-cores", action="store_true",
        help="give each local process its own share of the CPUs (fewer stalls in gloo's threads on a busy CPU)",
    )  # fmt: skip
    p.add_argument("--plan", type=Path, default=None, help="a plan from `stagewise plan --json` (sets the layout)")
    p.add_argument("--out", type=Path, default=Path("stagewise-run"), help="folder for summary.json and loss.png")


def config_of(ns: argparse.Namespace) -> TrainConfig:
    """The TrainConfig that ``stagewise train``'s parsed arguments ask for; a ``--plan`` sets the layout."""
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    values = {k: v for k, v in vars(ns).items() if k in names and not (k in PLANNED and v is None)}
    if ns.checkpoint_every and ns.checkpoint_dir is None:
        raise ValueError(
            f"--checkpoint-every {ns.checkpoint_every} saves checkpoints, but --no-checkpoints writes none; "
            "leave one of them out"
        )
    if ns.plan is not None:
        values.update(_planned(load_plan(ns.plan.read_text()), values))
    model = values.get("model", TrainConfig.model)
    text = (("--seq-len", ns.seq_len), ("--data", ns.data), ("--data-limit", ns.data_limit))
    given = [flag for flag, value in text if value is not None]
    if ns.data_limit is not None:
        values["data_limit"] = math.ceil(ns.data_limit)
    if not isinstance(preset(model), GPTConfig) and given:
        flag = given[0]
        raise ValueError(
            f"{flag} applies to the GPT presets, which read text; {model} trains on data of its own: "
            f"leave {flag} out, or choose a gpt-* model"
        )
    return TrainConfig(**values)


def _planned(chosen: dict[str, Any], given: dict[str, Any]) -> dict[str, Any]:
    """The settings a plan makes; a flag given with another value than the plan's is refused."""
    planned = {key: chosen[key] for key in ("model", "stages", "dp", "virtual", "schedule", "microbatches")}
    planned["batch_size"] = chosen["batch_size"]
    planned["activation_checkpointing"] = bool(chosen.get("activation_checkpointing", False))
    planned["partition"] = tuple(chosen["partition"])
    for key in ("seq_len", "optimizer"):  # plans of other presets, and older plans, may leave these out
        if chosen.get(key):
            planned[key] = chosen[key]
    clashes = [
        f"--{key.replace('_', '-')} {given[key]} (the plan's: {value})"
        for key, value in planned.items()
        if given.get(key) is not None and given[key] != value
    ]
    if clashes:
        raise ValueError(
            f"--plan sets the layout, but {', '.join(clashes)} asks for another; leave those flags out to train "
            "the plan, or plan again with them (stagewise plan --json)"
        )
    return planned


def _under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or "RANK" in os.environ


def run_rank(config: TrainConfig, verbose: bool = False) -> Summary:
    """One rank's part of ``train``: rank 0 shows the layout and a progress bar; ``verbose`` logs debug messages
    (a launched process configures its logging anew)."""
    logging.basicConfig(level=logging.DEBUG if verbose else logging.WARNING, format=args.LOG_FORMAT)
    rank = int(os.environ.get("RANK", "0"))
    bar: Any = None
    tokens = config.batch_size * config.tokens_per_sample

    def started(pipe: Pipeline) -> None:
        nonlocal bar
        if rank == 0:
            from tqdm import tqdm

            print(pipe.mesh.describe(), flush=True)
            print(f"partition {list(pipe.partition.bounds)}, schedule {pipe.schedule.name}", flush=True)
            bar = tqdm(total=config.steps, desc="train", unit="step", dynamic_ncols=True)

    def stepped(step: int, loss: float, seconds: float) -> None:
        if bar is None:
            return
        bar.update(step - bar.n)  # a resumed run starts at its step
        bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tokens / max(seconds, 1e-9):.0f}", step_s=f"{seconds:.2f}")

    try:
        summary = train(config, on_start=started, on_step=stepped)
    finally:
        if bar is not None:
            bar.close()
    # The job is over on every rank: release its groups (NCCL warns of a leak at exit for one left open).
    torch.distributed.destroy_process_group()
    return summary


def _strict(value: Any) -> Any:
    """``value`` with NaN and infinities as None: JSON has no words for them (a skipped step's loss)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _strict(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_strict(v) for v in value]
    return value


def report(summary: Summary, out: Path) -> list[str]:
    """Write summary.json (and loss.png with matplotlib) into ``out``; the lines to show."""
    out.mkdir(parents=True, exist_ok=True)
    data = dataclasses.asdict(summary) | {"tokens_per_second": summary.throughput()}
    (out / "summary.json").write_text(json.dumps(_strict(data), indent=1, allow_nan=False) + "\n")
    lines = []
    if summary.losses:
        lines.append(
            f"steps {summary.first_step + 1}..{summary.first_step + len(summary.losses)}: loss "
            f"{summary.losses[0]:.3f} -> {summary.losses[-1]:.3f}, {summary.throughput():.0f} tokens/s"
        )
    if summary.evals:
        lines.append("validation loss " + ", ".join(f"{v:.3f} (step {s})" for s, v in summary.evals))
    if summary.checkpoint:
        lines.append(f"checkpoint {summary.checkpoint}")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        lines.append(f"wrote {out / 'summary.json'} (install matplotlib for loss.png)")
        return lines
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


def _writable(flag: str, folder: Path) -> None:
    """Make ``folder`` now, so that an output that cannot be written fails before training, not after it."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ValueError(f"{flag}: cannot make the folder {folder} ({err.strerror}); choose a writable one") from err


def run(ns: argparse.Namespace) -> int:
    config = config_of(ns)
    _writable("--out", ns.out)
    if config.trace is not None:
        _writable("--trace", Path(config.trace).parent)
    if ns.max_restarts < 0:
        raise ValueError(f"--max-restarts must be >= 0, got {ns.max_restarts}")
    if _under_torchrun():
        if ns.pin_cores:
            raise ValueError("--pin-cores applies when stagewise starts the processes; torchrun started these")
        if ns.max_restarts:
            raise ValueError(
                "--max-restarts applies when stagewise starts the processes; torchrun started these: "
                "give torchrun --max-restarts (a restarted run resumes from --checkpoint-dir by itself)"
            )
        summary = run_rank(config)
        if int(os.environ.get("RANK", "0")) != 0:
            return 0
    else:
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        on_gpus = gpus >= config.world_size
        if ns.max_restarts and config.checkpoint_dir is None:
            raise ValueError("--max-restarts resumes from checkpoints; give --checkpoint-dir")
        preflight(config)
        found = checkpoint.latest(config.checkpoint_dir) if config.checkpoint_dir and not config.resume else None
        if found is not None:  # refused here, before any process starts (and is restarted to meet it again)
            raise ValueError(fresh_run_refused(str(config.checkpoint_dir), found))
        results = launch(
            run_rank,
            config.world_size,
            config,
            logging.getLogger("stagewise").isEnabledFor(logging.DEBUG),
            device="auto" if on_gpus else "cpu",
            tee=False,
            max_restarts=ns.max_restarts,
            layout=Layout(config.stages, config.dp),
            pin_cores=ns.pin_cores,
        )
        summary = results[0]
    for line in report(summary, ns.out):
        print(line)
    sys.stdout.flush()
    return 0
