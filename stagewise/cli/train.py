"""``stagewise train``: the main job, on local processes by default, or as one rank of a torchrun job.

Each setting of the run is a flag named as its key in the job file (:mod:`stagewise.run.job`): ``--config``
reads a job file, flags given override it, ``--print-config`` prints what the run would use.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path
from typing import Any, get_args

from stagewise.cli import args
from stagewise.cli.commands import COMMANDS
from stagewise.models import PRESETS
from stagewise.pipeline.config import GatherWhen, NonFinite
from stagewise.run.config import Optimizer, TrainConfig
from stagewise.run.runs import (
    IN_RUN_FOLDER,
    LATEST,
    ROOT,
    chosen_folder,
    in_folder,
    keep_config,
    made_folder,
    under_torchrun,
)
from stagewise.schedule import ScheduleName

DEFAULTS = TrainConfig()
TOKENS = "tokens"
"""Where under the runs' root the data a run tokenized is kept, one token file per corpus and tokenizer."""
COMMAND_ONLY = ("config", "print_config", "plan", "out", "max_restarts", "pin_cores", "command", "verbose")
"""The flags that are not settings of the run: where its settings and its folder come from, and how local
processes start."""


def add(commands: Any) -> None:
    p = commands.add_parser(
        "train",
        help=COMMANDS["train"].help,
        description="Train a model (a preset, or your own) split into pipeline stages. Without torchrun it starts "
        "pp x dp x fsdp x tp local processes itself (gloo on the CPU, NCCL when there is a GPU per process); "
        "under torchrun each process is one rank, so several nodes are plain torchrun. Every setting is also a key "
        "of a job file (--config run.toml), named as the flag.",
        argument_default=argparse.SUPPRESS,  # a flag not given is absent: the job file's or the default applies
    )
    p.add_argument(
        "--config", type=Path, default=None, metavar="TOML",
        help="a job file: the run's settings in sections, as --print-config prints them; flags override it",
    )  # fmt: skip
    p.add_argument(
        "--print-config", action="store_true", default=False,
        help="print the settings this command would train with, as a job file, and exit",
    )  # fmt: skip
    _model_and_data(p)
    _layout_and_schedule(p)
    _optimizer_and_compute(p)
    _checkpoints_and_logging(p)
    p.add_argument(
        "--max-restarts", type=int, default=0,
        help="restart all local processes this often after a failure, resuming from the latest checkpoint",
    )  # fmt: skip
    p.add_argument(
        "--pin-cores", action="store_true", default=False,
        help="give each local process its own share of the CPUs (fewer stalls in gloo's threads on a busy CPU)",
    )  # fmt: skip
    p.add_argument(
        "--plan", type=Path, default=None, help="a plan from `stagewise plan --json` (sets the layout it chose)"
    )
    p.add_argument(
        "--out", type=Path, default=None,
        help=f"this run's folder: config.toml, summary.json, loss.png, metrics.jsonl, checkpoints/ (default: a new "
        f"folder per run under {ROOT}/, linked as {ROOT}/{LATEST}; under torchrun, {ROOT}/ itself)",
    )  # fmt: skip


def _model_and_data(p: argparse.ArgumentParser) -> None:
    d = DEFAULTS
    p.add_argument(
        "--model", type=args.model_name,
        help=f"a preset ({', '.join(sorted(PRESETS))}), hf:DIR (a local Hugging Face folder: its config and weights) "
        f"or MODULE:FACTORY (a function returning a language model); default {d.model}",
    )  # fmt: skip
    p.add_argument("--seq-len", type=args.positive_int, help=f"tokens per sequence (default {d.seq_len})")
    p.add_argument("--seed", type=args.seed, help=f"seed of the weights and the data order (default {d.seed})")
    p.add_argument(
        "--data",
        help="a text file or folder, .jsonl, .parquet or .csv files, a folder save_to_disk wrote (datasets), or a "
        "token file (stagewise tokenize); default: the Python standard library's source, as bytes",
    )  # fmt: skip
    p.add_argument(
        "--tokenizer",
        help="a Hugging Face tokenizer's folder, or bytes (default: an hf:DIR model's own, else bytes); data it "
        "reads is tokenized once into stagewise-run/tokens/",
    )  # fmt: skip
    p.add_argument("--data-field", help=f"the field of a JSON line that holds the text (default {d.data_field})")
    p.add_argument(
        "--data-column",
        help=f"the column that holds the text (Parquet, CSV, a saved dataset; default {d.data_column})",
    )  # fmt: skip
    p.add_argument(
        "--data-limit", type=args.size, metavar="SIZE",
        help="read at most this much of the text, e.g. 64MiB (default: all of --data, 8 MiB of the stdlib source)",
    )  # fmt: skip
    p.add_argument(
        "--document-masking", action="store_true",
        help="keep packed documents apart: attention within each document, positions from its start, no loss "
        "across its end (GPT presets; Hugging Face models through position_ids); the data is tokenized into a token "
        "file, which knows its documents",
    )  # fmt: skip


def _layout_and_schedule(p: argparse.ArgumentParser) -> None:
    d = DEFAULTS
    p.add_argument("--pp", type=args.positive_int, help=f"pipeline ranks (default {d.pp})")
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
    p.add_argument(
        "--ep", type=args.positive_int,
        help=f"ranks each mixture-of-experts layer's experts are split over (expert parallelism, MoE presets), "
        f"borrowed from --fsdp (or, without it, from --dp): adds no processes (default {d.ep})",
    )  # fmt: skip
    p.add_argument(
        "--fsdp-gather", choices=get_args(GatherWhen),
        help=f"when FSDP gathers a stage's whole parameters: once per step, or around each action on a micro-batch "
        f"(freed between; gradients reduce-scattered after each backward; default {d.fsdp_gather})",
    )  # fmt: skip
    p.add_argument(
        "--offload-optimizer", action="store_true",
        help="keep the optimizer state and master weights in host memory, where the optimizer steps (FSDP's CPU "
        "offload)",
    )  # fmt: skip
    p.add_argument("--virtual", type=args.positive_int, help=f"stages per rank, interleaved (default {d.virtual})")
    p.add_argument(
        "--partition", type=args.bounds, metavar="BOUNDS",
        help="the stage bounds of the layers, e.g. 0,3,7 (default: split exactly by FLOPs)",
    )  # fmt: skip
    p.add_argument("--schedule", choices=get_args(ScheduleName), help=f"pipeline schedule (default {d.schedule})")
    p.add_argument("--microbatches", type=args.positive_int, help=f"micro-batches per step (default {d.microbatches})")
    p.add_argument("--batch-size", type=args.positive_int, help=f"global batch, samples (default {d.batch_size})")


def _optimizer_and_compute(p: argparse.ArgumentParser) -> None:
    d = DEFAULTS
    p.add_argument("--optimizer", choices=get_args(Optimizer), help=f"optimizer (default {d.optimizer})")
    p.add_argument("--lr", type=float, help=f"peak learning rate: warm-up, then cosine to lr/10 (default {d.lr})")
    p.add_argument("--warmup", type=int, help=f"warm-up steps (default {d.warmup})")
    p.add_argument(
        "--steps", type=args.positive_int, help=f"optimizer steps, the schedule's length (default {d.steps})"
    )
    p.add_argument("--clip", type=float, help=f"gradient norm clip, 0: off (default {d.clip})")
    p.add_argument("--bf16", action="store_true", help="bfloat16 autocast in the forward")
    p.add_argument(
        "--activation-checkpointing", nargs="?", const=True, choices=[True, "selective"], metavar="selective",
        help="recompute every layer's activations in backward; 'selective': all but the matmuls' outputs",
    )  # fmt: skip
    p.add_argument(
        "--offload-activations", action="store_true",
        help="keep the activations saved for backward in host memory (copied there during the forward, back for the "
        "backward; nothing moves on a CPU)",
    )  # fmt: skip
    p.add_argument(
        "--compile", action="store_true",
        help="compile each layer with torch.compile (inductor; the first step compiles, for seconds to minutes)",
    )  # fmt: skip
    p.add_argument(
        "--no-weight-gradient-fusion", dest="weight_gradient_fusion", action="store_false",
        help="leave weight-gradient accumulation to autograd (default: large linear weights accumulate in backward)",
    )  # fmt: skip
    p.add_argument(
        "--weight-gradient-pool", type=args.pool, metavar="K",
        help="pool K backwards' weight gradients into one GEMM per weight, or 'free' (the default): as many as "
        "fit in the pipeline's peak of micro-batches in flight (a whole step for gpipe, r + 1 on rank r for 1f1b; "
        "zero-bubble and activation checkpointing never pool)",
    )  # fmt: skip


def _checkpoints_and_logging(p: argparse.ArgumentParser) -> None:
    d = DEFAULTS
    p.add_argument("--eval-every", type=int, help=f"validate every N steps, 0: at the end (default {d.eval_every})")
    p.add_argument("--eval-batches", type=args.positive_int, help=f"validation batches (default {d.eval_batches})")
    p.add_argument(
        "--checkpoint-dir", help=f"write checkpoints here (default: {IN_RUN_FOLDER['checkpoint_dir']}, in --out)"
    )
    p.add_argument("--no-checkpoints", dest="checkpoint_dir", action="store_const", const=None, help="write none")
    p.add_argument("--checkpoint-every", type=int, help="save every N steps (default: 0, at the end)")
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
    p.add_argument("--stop-after", type=args.positive_int, help="end after this step (resume later)")
    p.add_argument(
        "--metrics", metavar="PATH", help=f"append each step's metrics here (default {IN_RUN_FOLDER['metrics']})"
    )
    p.add_argument(
        "--tensorboard", nargs="?", const="RUN/tensorboard", metavar="DIR",
        help="also write the metrics for TensorBoard, by default into tensorboard/ in the run's folder (the "
        "tensorboard extra)",
    )  # fmt: skip
    p.add_argument(
        "--wandb", nargs="?", const="RUN/wandb", metavar="DIR",
        help="also log the metrics to an offline Weights & Biases run, by default in wandb/ in the run's folder (the "
        "wandb extra; WANDB_MODE=online to upload as it goes)",
    )  # fmt: skip
    p.add_argument(
        "--log-every", type=args.positive_int, metavar="N",
        help=f"where the output is no terminal (a log file), print a line every N steps instead of a progress bar "
        f"(default {d.log_every})",
    )  # fmt: skip
    p.add_argument("--trace", help="write a Chrome trace of the last step here (per rank)")
    p.add_argument(
        "--nonfinite", choices=get_args(NonFinite),
        help="on a NaN or infinite loss, stop with an error naming it (raise, the default) or skip the step",
    )  # fmt: skip
    p.add_argument("--timeout", type=float, help=f"seconds a rank waits for another (default {d.timeout:g})")


def config_of(ns: argparse.Namespace) -> TrainConfig:
    """The TrainConfig that ``stagewise train``'s parsed arguments ask for: the defaults, its job file, its plan,
    then its flags (see :func:`~stagewise.run.job.resolved`); paths in the run's folder are still ``RUN/...``."""
    from stagewise.run.job import resolved

    given = {k: v for k, v in vars(ns).items() if k not in COMMAND_ONLY}
    if "data_limit" in given:
        given["data_limit"] = math.ceil(given["data_limit"])
    return resolved(given, defaults=IN_RUN_FOLDER, job_file=ns.config, plan_file=ns.plan)


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
    from stagewise.run.data import needs_tokenizing, prepared, tokenizer_of
    from stagewise.run.documents import files

    if not needs_tokenizing(config) or config.data is None:
        return prepared(config, ROOT / TOKENS)  # checks the tokenizer against the model
    from tqdm import tqdm

    total = sum(p.stat().st_size for p in files(Path(config.data)))
    print(f"stagewise train: tokenizing {config.data} with {tokenizer_of(config)} (once)", flush=True)
    with tqdm(total=total, unit="B", unit_scale=True, desc="tokenize", disable=not sys.stderr.isatty()) as bar:
        return prepared(config, ROOT / TOKENS, progress=bar.update)


def run(ns: argparse.Namespace) -> int:
    from stagewise.run.job import config_text

    config = config_of(ns)
    if ns.print_config:
        print(config_text(config), end="")
        return 0
    torchrun = under_torchrun()
    chosen = chosen_folder(ns.out, config, torchrun=torchrun)
    if not torchrun:  # the first line, before the heavier parts load, the data is read and the model costed
        print(f"stagewise train: {config.model} on {config.world_size} local processes ({config.layout.describe()}), "
              f"{config.steps} steps", flush=True)  # fmt: skip
    import torch

    from stagewise.cli.progress import Progress
    from stagewise.cli.run_report import report
    from stagewise.run.launching import LocalLaunch, checked_before_start, crowding, launched
    from stagewise.run.rank import run_rank

    local = LocalLaunch(ns.max_restarts, ns.pin_cores)
    if not torchrun:
        config = _tokenized(config)
    checked_before_start(in_folder(config, chosen or ROOT / "new"), local, torchrun=torchrun)
    out = made_folder(chosen)
    config = in_folder(config, out)
    if int(os.environ.get("RANK", "0")) == 0:
        keep_config(out, config)
    if torchrun:
        _say_where_nodes_meet()
        summary = run_rank(config, reporter=Progress)
        if int(os.environ.get("RANK", "0")) != 0:
            return 0
    else:
        print(f"stagewise train: run folder {out}", flush=True)
        crowded = crowding(config.world_size)
        if crowded is not None and not torch.cuda.is_available():
            print(f"stagewise train: warning: {crowded}", file=sys.stderr, flush=True)
        results = launched(config, local, out, Progress)
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
