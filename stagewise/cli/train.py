"""``stagewise train``: the main job, on local processes by default, or as one rank of a torchrun job."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import math
import os
import sys
from pathlib import Path
from typing import Any, get_args

import torch

from stagewise import checkpoint
from stagewise.cli import args
from stagewise.cli.args import JobFailedError
from stagewise.cli.progress import Progress
from stagewise.cli.run_report import report
from stagewise.comm import LaunchError, Layout, launch
from stagewise.models import PRESETS, GPTConfig
from stagewise.plan.plan_file import read_plan
from stagewise.run import Optimizer, Summary, TrainConfig, preflight, train
from stagewise.run.data import needs_tokenizing, prepared, tokenizer_of
from stagewise.run.documents import files
from stagewise.run.resume import check_resume, fresh_run_refused
from stagewise.run.runs import LATEST, ROOT, latest_run, new_run
from stagewise.run.stopping import StopSignals
from stagewise.run.user_model import UserModel, model_of
from stagewise.schedule import ScheduleName

DEFAULTS = TrainConfig()
TORCH_LAUNCHER_LOGGERS = ("torch.distributed.elastic", "torch.multiprocessing")
"""The loggers of torch's agent, which the launching process quiets unless asked to be verbose."""
TOKENS = "tokens"
"""Where under the runs' root the data a run tokenized is kept, one token file per corpus and tokenizer."""
METRICS = "metrics.jsonl"
"""The run folder's file of metrics: one JSON line per step and evaluation."""
IN_RUN_FOLDER = "RUN/checkpoints"
"""--checkpoint-dir's default: ``checkpoints/`` in the run's folder, whichever it is."""
PLANNED = (
    "model", "stages", "dp", "fsdp", "tp", "virtual", "schedule", "microbatches", "batch_size",
    "activation_checkpointing", "seq_len", "optimizer",
)  # fmt: skip
"""The settings a --plan makes; their flags default to None (given: a value, even the default's)."""


def add(commands: Any) -> None:
    p = commands.add_parser(
        "train",
        help="train a model with a pipeline (the main job)",
        description="Train a model (a preset, or your own) split into pipeline stages. Without torchrun it starts "
        "stages x dp x fsdp x tp local processes itself (gloo on the CPU, NCCL when there is a GPU per process); "
        "under torchrun each process is one rank, so several nodes are plain torchrun.",
    )
    d = DEFAULTS
    # The layout's flags default to None, so that a --plan can tell a flag given (even as the default) from none.
    p.add_argument(
        "--model", type=args.model_name,
        help=f"a preset ({', '.join(sorted(PRESETS))}), hf:DIR (a local Hugging Face folder: its config and weights) "
        f"or MODULE:FACTORY (a function returning a language model); default {d.model}",
    )  # fmt: skip
    p.add_argument("--stages", type=args.positive_int, help=f"pipeline ranks (default {d.stages})")
    p.add_argument("--virtual", type=args.positive_int, help=f"stages per rank, interleaved (default {d.virtual})")
    p.add_argument("--dp", type=args.positive_int, help=f"data-parallel replicas of the pipeline (default {d.dp})")
    p.add_argument(
        "--fsdp", type=args.positive_int,
        help=f"ranks each replica shards its stages' parameters, gradients and optimizer state over (FSDP; default "
        f"{d.fsdp})",
    )  # fmt: skip
    p.add_argument(
        "--tp", type=args.positive_int,
        help=f"ranks each layer is split over (tensor parallelism, GPT presets; default {d.tp})",
    )  # fmt: skip
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
        "--compile", action="store_true",
        help="compile each layer with torch.compile (inductor; the first step compiles, for seconds to minutes)",
    )  # fmt: skip
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
    p.add_argument("--seed", type=args.seed, default=d.seed, help="seed of the weights and the data order")
    p.add_argument(
        "--data", default=d.data,
        help="a text file or folder, .jsonl, .parquet or .csv files, a folder save_to_disk wrote (datasets), or a "
        "token file (stagewise tokenize); default: the Python standard library's source, as bytes",
    )  # fmt: skip
    p.add_argument(
        "--tokenizer", default=None,
        help="a Hugging Face tokenizer's folder, or bytes (default: an hf:DIR model's own, else bytes); data it "
        "reads is tokenized once into stagewise-run/tokens/",
    )  # fmt: skip
    p.add_argument("--data-field", default=d.data_field, help="the field of a JSON line that holds the text")
    p.add_argument(
        "--data-column", default=d.data_column, help="the column that holds the text (Parquet, CSV, a saved dataset)"
    )
    p.add_argument(
        "--data-limit", type=args.size, default=None, metavar="SIZE",
        help="read at most this much of the text, e.g. 64MiB (default: all of --data, 8 MiB of the stdlib source)",
    )  # fmt: skip
    p.add_argument(
        "--document-masking", action="store_true",
        help="keep packed documents apart: attention within each document, positions from its start, no loss "
        "across its end (GPT presets; Hugging Face models through position_ids); the data is tokenized into a token "
        "file, which knows its documents",
    )  # fmt: skip
    p.add_argument("--eval-every", type=int, default=d.eval_every, help="validate every N steps (0: at the end)")
    p.add_argument("--eval-batches", type=args.positive_int, default=d.eval_batches, help="validation batches")
    p.add_argument(
        "--checkpoint-dir", default=IN_RUN_FOLDER, help="write checkpoints here (default: checkpoints/ in --out)"
    )
    p.add_argument("--no-checkpoints", dest="checkpoint_dir", action="store_const", const=None, help="write none")
    p.add_argument("--checkpoint-every", type=int, default=d.checkpoint_every, help="save every N steps (0: at end)")
    p.add_argument(
        "--checkpoint-async", action="store_true",
        help="save in the background: the state is copied to host memory at the step's end and written while "
        "training goes on (one save in flight)",
    )  # fmt: skip
    p.add_argument(
        "--no-verify-checksums", dest="verify_checksums", action="store_false",
        help="on resume, check the checkpoint's file sizes against its manifest but not their CRC-32 (which reads "
        "the whole checkpoint once more)",
    )  # fmt: skip
    p.add_argument(
        "--resume", action="store_true",
        help=f"continue the latest run ({ROOT}/{LATEST}, or the run in --out) from its latest checkpoint",
    )  # fmt: skip
    p.add_argument("--trace", default=d.trace, help="write a Chrome trace of the last step here (per rank)")
    p.add_argument(
        "--tensorboard", action="store_true",
        help="also write the metrics for TensorBoard, into tensorboard/ in the run's folder (the tensorboard extra)",
    )  # fmt: skip
    p.add_argument(
        "--wandb", action="store_true",
        help="also log the metrics to an offline Weights & Biases run in wandb/ in the run's folder (the wandb "
        "extra; WANDB_MODE=online to upload as it goes)",
    )  # fmt: skip
    p.add_argument(
        "--log-every", type=args.positive_int, default=d.log_every, metavar="N",
        help="where the output is no terminal (a log file), print a line every N steps instead of a progress bar",
    )  # fmt: skip
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
    p.add_argument(
        "--out", type=Path, default=None,
        help=f"this run's folder: summary.json, loss.png, checkpoints/ (default: a new folder per run under {ROOT}/, "
        f"linked as {ROOT}/{LATEST}; under torchrun, {ROOT}/ itself)",
    )  # fmt: skip


def config_of(ns: argparse.Namespace, folder: Path | None = None) -> TrainConfig:
    """The TrainConfig that ``stagewise train``'s parsed arguments ask for, writing into the run ``folder`` (None:
    one to be made); a ``--plan`` sets the layout."""
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    values = {k: v for k, v in vars(ns).items() if k in names and not (k in PLANNED and v is None)}
    if values.get("checkpoint_dir") == IN_RUN_FOLDER:
        values["checkpoint_dir"] = str((folder or ROOT / "new") / "checkpoints")
    if ns.checkpoint_every and ns.checkpoint_dir is None:
        raise ValueError(
            f"--checkpoint-every {ns.checkpoint_every} saves checkpoints, but --no-checkpoints writes none; "
            "leave one of them out"
        )
    if ns.plan is not None:  # checked field by field; a MODULE:FACTORY only as the command line's --model
        values.update(_planned(read_plan(ns.plan, model=values.get("model")), values))
    model = values.get("model", TrainConfig.model)
    text = (
        ("--seq-len", ns.seq_len),
        ("--data", ns.data),
        ("--data-limit", ns.data_limit),
        ("--document-masking", ns.document_masking or None),
        ("--tokenizer", ns.tokenizer),
    )
    given = [flag for flag, value in text if value is not None]
    if ns.data_limit is not None:
        values["data_limit"] = math.ceil(ns.data_limit)
    if not isinstance(model_of(model), (GPTConfig, UserModel)) and given:
        flag = given[0]
        raise ValueError(
            f"{flag} applies to language models, which read text; {model} trains on data of its own: "
            f"leave {flag} out, or choose a gpt-* model"
        )
    return TrainConfig(**values)


def _planned(chosen: dict[str, Any], given: dict[str, Any]) -> dict[str, Any]:
    """The settings a plan makes (``chosen``, checked field by field by :func:`~stagewise.plan.plan_file.load_plan`);
    a flag given with another value than the plan's is refused."""
    planned = {key: chosen[key] for key in ("model", "stages", "dp", "virtual", "schedule", "microbatches")}
    planned["fsdp"], planned["tp"] = chosen.get("fsdp", 1), chosen.get("tp", 1)  # plans from before they were searched
    planned["batch_size"] = chosen["batch_size"]
    planned["activation_checkpointing"] = chosen.get("activation_checkpointing", False)  # a JSON boolean
    planned["partition"] = tuple(chosen["partition"])
    if chosen.get("schedule_text"):  # a schedule synthesised for the planned stages (plan --synthesise)
        planned["schedule_text"] = chosen["schedule_text"]
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
    """One rank's part of ``train``: rank 0 shows the layout and the progress
    (:class:`~stagewise.cli.progress.Progress`); ``verbose`` logs debug messages (a launched process configures its
    logging anew)."""
    logging.basicConfig(level=logging.DEBUG if verbose else logging.WARNING, format=args.LOG_FORMAT)
    shown = Progress(config) if int(os.environ.get("RANK", "0")) == 0 else None
    try:
        with StopSignals() as stop:
            summary = train(
                config,
                on_start=shown.started if shown else None,
                on_step=shown.stepped if shown else None,
                stop=stop,
            )
    finally:
        if shown is not None:
            shown.close()
    # The job is over on every rank: release its groups (NCCL warns of a leak at exit for one left open).
    torch.distributed.destroy_process_group()
    return summary


def _writable(flag: str, folder: Path) -> None:
    """Make ``folder`` now, so that an output that cannot be written fails before training, not after it."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ValueError(f"{flag}: cannot make the folder {folder} ({err.strerror}); choose a writable one") from err


def _chosen_folder(ns: argparse.Namespace, torchrun: bool) -> Path | None:
    """The run's folder when the command names one: --out, the latest run for --resume, or under torchrun the
    root (every rank must name the same folder); None: a new one, made once everything is checked."""
    if ns.out is not None:
        return Path(ns.out)
    if torchrun:
        return ROOT
    if ns.resume and ns.checkpoint_dir == IN_RUN_FOLDER:  # the run's checkpoints are in its folder: find it
        found = latest_run(ROOT)
        if found is None:
            raise ValueError(
                f"--resume continues the latest run in {ROOT}/, but there is none there; start one without --resume, "
                "or name the run's folder with --out"
            )
        return found
    return None


def _checked_before_start(ns: argparse.Namespace, config: TrainConfig, torchrun: bool) -> None:
    """What the ranks would refuse, checked here first: a bad value is one line, not a traceback per rank."""
    if config.trace is not None:
        _writable("--trace", Path(config.trace).parent)
    if ns.max_restarts < 0:
        raise ValueError(f"--max-restarts must be >= 0, got {ns.max_restarts}")
    if torchrun and ns.pin_cores:
        raise ValueError("--pin-cores applies when stagewise starts the processes; torchrun started these")
    if torchrun and ns.max_restarts:
        raise ValueError(
            "--max-restarts applies when stagewise starts the processes; torchrun started these: "
            "give torchrun --max-restarts (a restarted run resumes from --checkpoint-dir by itself)"
        )
    if torchrun:
        return
    if ns.max_restarts and config.checkpoint_dir is None:
        raise ValueError("--max-restarts resumes from checkpoints; give --checkpoint-dir")
    preflight(config)
    check_resume(config)
    found = checkpoint.latest(config.checkpoint_dir) if config.checkpoint_dir and not config.resume else None
    if found is not None:  # refused here, before any process starts (and is restarted to meet it again)
        raise ValueError(fresh_run_refused(str(config.checkpoint_dir), found))


def _made_folder(ns: argparse.Namespace, config: TrainConfig, chosen: Path | None) -> tuple[Path, TrainConfig]:
    """The run's folder, made now (a new one when none was chosen), and the config writing its checkpoints and
    metrics there."""
    if chosen is not None:
        _writable("--out", chosen)
        out = chosen
    else:
        _writable("--out", ROOT)
        out = new_run(ROOT)
        if ns.checkpoint_dir == IN_RUN_FOLDER:
            config = dataclasses.replace(config, checkpoint_dir=str(out / "checkpoints"))
    return out, dataclasses.replace(
        config,
        metrics=str(out / METRICS),
        tensorboard=str(out / "tensorboard") if ns.tensorboard else None,
        wandb=str(out / "wandb") if ns.wandb else None,
    )


def crowding(processes: int, cores: int | None = None) -> str | None:
    """Why ``processes`` local processes on ``cores`` CPU cores (this process's, by default) will be slow, if so."""
    if cores is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if processes <= cores:
        return None
    return (
        f"{processes} processes share {cores} CPU cores, so each step waits for processes that are not running; "
        f"at most {cores} processes (--stages x --dp x --fsdp x --tp) run at full speed"
    )


def _layout(config: TrainConfig) -> str:
    """``2 stages x dp 1``, with ``x fsdp N x tp N`` where they are not 1."""
    text = f"{config.stages} stages x dp {config.dp}"
    for name in ("fsdp", "tp"):
        if getattr(config, name) > 1:
            text += f" x {name} {getattr(config, name)}"
    return text


def _launched(ns: argparse.Namespace, config: TrainConfig, out: Path) -> dict[int, Summary]:
    """Run ``config`` on local processes; a failure is one line naming the rank, its stage and the cause, with
    the whole report (every rank's traceback) in ``out/error.log``."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    verbose = logging.getLogger("stagewise").isEnabledFor(logging.DEBUG)
    if not verbose:  # torch's agent logs a failed rank's traceback too: the user gets one line, the log the rest
        for name, logger in list(logging.root.manager.loggerDict.items()):
            if isinstance(logger, logging.Logger) and name.startswith(TORCH_LAUNCHER_LOGGERS):
                logger.setLevel(logging.CRITICAL)
    try:
        return launch(
            run_rank,
            config.world_size,
            config,
            verbose,
            device="auto" if gpus >= config.world_size else "cpu",
            tee=False,
            max_restarts=ns.max_restarts,
            layout=Layout(config.stages, config.dp, config.fsdp, config.tp),
            pin_cores=ns.pin_cores,
            pass_stop_signals=True,
        )
    except LaunchError as err:
        log = out / "error.log"
        log.write_text(f"{err}\n")
        raise JobFailedError(f"{err.headline} (the full report: {log})") from None


def _say_where_nodes_meet() -> None:
    """Under torchrun on several nodes, rank 0 prints the job's store and id: every node reaches them, and so can
    anyone else on that network."""
    env = os.environ
    if env.get("RANK", "0") != "0" or env.get("WORLD_SIZE") == env.get("LOCAL_WORLD_SIZE", env.get("WORLD_SIZE")):
        return
    print(
        f"stagewise train: {env.get('WORLD_SIZE')} processes on several nodes; the job's store is "
        f"{env.get('MASTER_ADDR')}:{env.get('MASTER_PORT')} (job id {env.get('TORCHELASTIC_RUN_ID', 'none')}): "
        "anyone who reaches it can join or disturb the job, so keep the nodes on a trusted network and give each "
        "job an id of its own (torchrun --rdzv-id)",
        flush=True,
    )


def _tokenized(config: TrainConfig) -> TrainConfig:
    """``config`` with its data tokenized where it must be (:func:`~stagewise.run.data.prepared`), with a bar."""
    if not needs_tokenizing(config) or config.data is None:
        return prepared(config, ROOT / TOKENS)  # checks the tokenizer against the model
    from tqdm import tqdm

    total = sum(p.stat().st_size for p in files(Path(config.data)))
    print(f"stagewise train: tokenizing {config.data} with {tokenizer_of(config)} (once)", flush=True)
    with tqdm(total=total, unit="B", unit_scale=True, desc="tokenize", disable=not sys.stderr.isatty()) as bar:
        return prepared(config, ROOT / TOKENS, progress=bar.update)


def run(ns: argparse.Namespace) -> int:
    torchrun = _under_torchrun()
    chosen = _chosen_folder(ns, torchrun)
    config = config_of(ns, chosen)
    if not torchrun:
        config = _tokenized(config)
    _checked_before_start(ns, config, torchrun)
    out, config = _made_folder(ns, config, chosen)
    if torchrun:
        _say_where_nodes_meet()
        summary = run_rank(config)
        if int(os.environ.get("RANK", "0")) != 0:
            return 0
    else:
        print(f"stagewise train: {config.world_size} local processes ({_layout(config)}), run folder {out}",
              flush=True)  # fmt: skip
        crowded = crowding(config.world_size)
        if crowded is not None and not torch.cuda.is_available():
            print(f"stagewise train: warning: {crowded}", file=sys.stderr, flush=True)
        results = _launched(ns, config, out)
        summary = results[0]
    for line in report(summary, out):
        print(line, flush=True)
    if summary.stopped is None:
        return 0
    again = "python -m stagewise train --resume" + (f" --out {out}" if ns.out is not None else "")
    print(
        f"stopped by {summary.stopped} after step {summary.first_step + len(summary.losses)} of {config.steps}; "
        f"checkpoint {summary.checkpoint or 'none (--no-checkpoints)'}; continue with: {again}",
        flush=True,
    )
    return 130 if summary.stopped == "SIGINT" else 0
