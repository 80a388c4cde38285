"""TrainConfig: everything one training run needs, checked on construction; its defaults are the embedded job."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, get_args

from stagewise.comm.layout import Layout
from stagewise.comm.timeouts import DEFAULT_TIMEOUT
from stagewise.errors import is_whole
from stagewise.models import GPTConfig
from stagewise.pipeline import NonFinite, WeightGradientFusion
from stagewise.pipeline.config import GatherWhen
from stagewise.pipeline.stage.materialise import layer_seed
from stagewise.run.user_model import UserModel, model_of
from stagewise.schedule import ScheduleName

Optimizer = Literal["adamw", "sgd"]
"""The optimizers ``train`` offers."""

TORCH_SEEDS = range(-(2**63), 2**64)
"""The seeds ``torch.manual_seed`` takes (tried: -2**63 - 1 and 2**64 overflow; a negative seed counts from
2**64)."""
_STRIDE = layer_seed(1, 0) - layer_seed(0, 0)
SEEDS = range(-(-TORCH_SEEDS.start // _STRIDE), TORCH_SEEDS.stop // _STRIDE)
"""The seeds a run takes: those whose every layer's seed (``seed x stride + layer``, see
:func:`~stagewise.pipeline.stage.materialise.layer_seed`) torch takes too, on every rank, for layers fewer than the
stride (a million)."""


def check_seed(seed: object, what: str = "seed") -> int:
    """``seed`` if it is a whole number in :data:`SEEDS`; else a one-line ValueError naming ``what``."""
    if not is_whole(seed) or seed not in SEEDS:
        raise ValueError(
            f"{what} must be a whole number from {SEEDS.start} to {SEEDS.stop - 1}, got {seed!r}: each layer is "
            f"seeded with seed x {_STRIDE} + its index, which torch.manual_seed takes from -2**63 to 2**64 - 1"
        )
    return seed


@dataclass(frozen=True)
class TrainConfig:
    """Everything one training run needs; the defaults are the embedded job that runs on a 2-core laptop."""

    model: str = "gpt-tiny"
    """Model preset (see ``stagewise.models.PRESETS``), ``hf:DIR`` (a local Hugging Face folder: its config, and
    its weights when it has them) or ``MODULE:FACTORY`` (a function returning a language model); the last two train
    on the text data (see :class:`~stagewise.run.user_model.UserModel`)."""
    pp: int = 2
    """Pipeline ranks (the mesh's ``pp``); with ``virtual`` stages each, the model is split into ``pp * virtual``
    stages."""
    virtual: int = 1
    """Stages per pipeline rank (2 or more for the interleaved schedule)."""
    dp: int = 1
    """Data-parallel replicas of the whole pipeline; the job runs ``pp * dp * fsdp * tp`` processes."""
    fsdp: int = 1
    """Ranks each replica shards its stages' parameters, gradients and optimizer state over (FSDP; with ``dp``:
    HSDP); each takes its own share of the batch."""
    tp: int = 1
    """Ranks each layer is split over (tensor parallelism: GPT presets' attention heads, MLP and vocabulary)."""
    ep: int = 1
    """Ranks each mixture-of-experts layer's experts are split over (expert parallelism), borrowed from ``fsdp``
    (or, with ``fsdp = 1``, from ``dp``): it divides that dimension and adds no processes."""
    fsdp_gather: GatherWhen = "step"
    """When FSDP gathers a stage's whole parameters: once per "step" (held whole, with their gradients, until its
    end), or around each of its actions on a "micro-batch" (freed between, gradients reduce-scattered after each
    backward: :attr:`stagewise.pipeline.FullySharded.gather`); "micro-batch" needs ``fsdp > 1``."""
    offload_optimizer: bool = False
    """Keep the optimizer state and master weights in host memory, where the optimizer steps (FSDP's CPU offload,
    :attr:`stagewise.pipeline.FullySharded.offload`; the stages are wrapped by FSDP even with ``fsdp == 1``)."""
    schedule: ScheduleName = "1f1b"
    """Pipeline schedule."""
    schedule_text: str | None = None
    """A schedule in the text form (:meth:`~stagewise.schedule.Schedule.to_text`), trained instead of
    :attr:`schedule`: one ``stagewise plan --synthesise`` built for the planned stages; None: :attr:`schedule`."""
    microbatches: int = 4
    """Micro-batches per step and replica."""
    batch_size: int = 16
    """Samples per step over all replicas (the global batch)."""
    seq_len: int = 128
    """Tokens per sequence, for GPT presets."""
    steps: int = 400
    """Optimizer steps in all; the learning-rate schedule spans them."""
    stop_after: int | None = None
    """End this run after this step, with a checkpoint, to resume later (a job time limit); None runs to the end."""
    lr: float = 3e-3
    """Peak learning rate, reached after ``warmup`` steps and decayed along a cosine to a tenth."""
    warmup: int = 10
    """Steps of linear learning-rate warm-up."""
    optimizer: Optimizer = "adamw"
    """AdamW (weight decay 0.01) or SGD with momentum 0.9."""
    clip: float = 1.0
    """Clip the gradients' global norm to this; 0 turns clipping off."""
    bf16: bool = False
    """Run forwards under bfloat16 autocast."""
    activation_checkpointing: bool | Literal["selective"] = False
    """Recompute activations in backward instead of keeping them: True every layer's whole forward, "selective"
    all but the matmuls' and attention's outputs (:class:`~stagewise.pipeline.SelectiveCheckpointing`)."""
    offload_activations: bool = False
    """Keep the activations saved for backward in host memory (:attr:`stagewise.pipeline.Compute.offload_activations`;
    nothing moves on a CPU device)."""
    compile: bool = False
    """Compile each layer with ``torch.compile`` (inductor; see :attr:`stagewise.pipeline.Compute.compile`)."""
    weight_gradient_fusion: bool = True
    """Accumulate large linear weights' gradients inside the backward (:class:`WeightGradientFusion`); False leaves
    every weight gradient to autograd."""
    weight_gradient_pool: int | Literal["free"] | None = "free"
    """Backwards of a rank whose weight gradients are pooled into one GEMM per weight (more memory held, less memory
    traffic); "free": as many as fit in the pipeline's peak in flight (a whole step for GPipe); None: only within
    each stage's own micro-batches in flight (a whole step for GPipe, none for the others; see
    :attr:`WeightGradientFusion.pool`)."""
    seed: int = 0
    """Seed of the initial weights (layer i from (seed, i)) and of the data order."""
    data: str | None = None
    """What a language model trains on: a text file or folder, JSON lines (:attr:`data_field`), Parquet, CSV or a
    folder Hugging Face ``datasets`` saved (:attr:`data_column`), or a token file (``stagewise tokenize``); by
    default the Python standard library's source, as bytes."""
    tokenizer: str | None = None
    """What reads the data: ``bytes``, or a Hugging Face tokenizer's folder; None: an ``hf:DIR`` model's own
    tokenizer, else bytes (see :mod:`stagewise.run.data`)."""
    data_field: str = "text"
    """The field of a JSON lines file that holds each document's text."""
    data_column: str = "text"
    """The column that holds each document's text: of a Parquet or CSV file, or of a saved dataset."""
    document_masking: bool = False
    """Keep the packed documents of a window apart: each token attends only to its own document, positions count
    from each document's start, and no target crosses a document's end, so each document trains as if it ran
    alone (a GPT preset, or a Hugging Face model through ``position_ids``; see
    :mod:`stagewise.run.token_windows`). The data is read as a token file, which knows its documents."""
    data_limit: int | None = None
    """Bytes of the text read at most; None: all of ``data``, or 8 MiB of the standard library's source."""
    eval_every: int = 100
    """Evaluate on the validation split every this many steps (and at the end); 0 only at the end."""
    eval_batches: int = 4
    """Validation batches per evaluation."""
    checkpoint_dir: str | None = None
    """Where checkpoints go; none are written without it."""
    checkpoint_every: int = 0
    """Save every this many steps (and at the end); 0 only at the end."""
    checkpoint_async: bool = False
    """Save in the background: the state is staged in host memory at the step's end and written while training
    goes on (DCP's async save), at most one save in flight (see :class:`stagewise.checkpoint.Checkpointer`)."""
    verify_checksums: bool = True
    """On resume, rank 0 checks every file of the checkpoint against its manifest's CRC-32, not only its size
    (a read of the whole checkpoint); a newest checkpoint that fails is passed over for the one before it."""
    resume: bool = False
    """Continue from the latest complete checkpoint in ``checkpoint_dir``. Without it a run refuses a
    ``checkpoint_dir`` that already holds checkpoints (an earlier run's), except when torchrun's agent has
    restarted it after a failure: a restart continues from the latest checkpoint of its own job (see
    :func:`train`)."""
    metrics: str | None = None
    """Where rank 0 appends one JSON line per step and evaluation (``stagewise train``: ``metrics.jsonl`` in the
    run's folder); None writes none."""
    tensorboard: str | None = None
    """A folder for TensorBoard's event files (the ``tensorboard`` extra); None writes none."""
    wandb: str | None = None
    """A folder for an offline Weights & Biases run (the ``wandb`` extra; ``WANDB_MODE`` may set another mode);
    None: no W&B run."""
    log_every: int = 10
    """On a terminal, rank 0 shows a progress bar; where its output is no terminal (a log file), a line every
    this many steps."""
    trace: str | None = None
    """Write a Chrome/Perfetto trace of this run's last step here (one file per rank)."""
    timeout: float = DEFAULT_TIMEOUT
    """Seconds any rank waits for another before failing with a named error."""
    nonfinite: NonFinite = "raise"
    """On a NaN or infinite loss: "raise" (naming the step and micro-batch) or "skip" the step."""
    partition: tuple[int, ...] | None = None
    """Stage boundaries to use (e.g. from ``stagewise plan``) instead of splitting by FLOPs."""

    def __post_init__(self) -> None:
        self._check_numbers()
        self._check_weight_gradients()
        self._check_sharding()
        self._check_run_folder()
        model = model_of(self.model)  # an unknown model fails here, with the choices
        if self.document_masking and not isinstance(model, (GPTConfig, UserModel)):
            raise ValueError(
                f"document_masking keeps a language model's documents apart, but {self.model} reads no text; "
                "leave it out, or choose a language model"
            )
        if self.document_masking and self.data is None:
            raise ValueError(
                "document_masking needs the data's documents, but the default data (the standard library's source "
                "read as one stream of bytes) marks none; give data: files (one document each), JSON lines or Parquet"
            )
        if self.partition is not None and len(self.partition) != self.pp * self.virtual + 1:
            raise ValueError(
                f"the partition {list(self.partition)} has {len(self.partition) - 1} stages, but pp x virtual "
                f"= {self.pp * self.virtual}; give {self.pp * self.virtual + 1} boundaries"
            )

    def _check_numbers(self) -> None:
        for name in (
            "pp",
            "virtual",
            "dp",
            "fsdp",
            "tp",
            "ep",
            "microbatches",
            "batch_size",
            "seq_len",
            "steps",
            "eval_batches",
            "log_every",
        ):
            value = getattr(self, name)
            if not is_whole(value) or value < 1:
                raise ValueError(f"{name} must be a whole number >= 1, got {value!r}")
        check_seed(self.seed)
        if self.data_limit is not None and (isinstance(self.data_limit, bool) or not self.data_limit >= 1):
            raise ValueError(f"data_limit must be a number of bytes >= 1 (or None: all), got {self.data_limit!r}")
        for name in ("warmup", "eval_every", "checkpoint_every"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name, value in (("lr", self.lr), ("timeout", self.timeout)):
            if not 0 < value < math.inf:
                raise ValueError(f"{name} must be a positive, finite number, got {value}")
        if not 0 <= self.clip < math.inf:
            raise ValueError(f"clip must be a finite number >= 0 (0 turns it off), got {self.clip}")

    def _check_sharding(self) -> None:
        if self.fsdp_gather not in get_args(GatherWhen):
            raise ValueError(f"fsdp_gather must be 'step' or 'micro-batch', got {self.fsdp_gather!r}")
        if self.fsdp_gather == "micro-batch" and self.fsdp == 1:
            raise ValueError(
                "fsdp_gather='micro-batch' gathers each stage's sharded parameters around its actions, but fsdp=1 "
                "shards nothing; give fsdp > 1, or leave fsdp_gather at 'step'"
            )
        for name in ("offload_optimizer", "offload_activations"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be true or false, got {getattr(self, name)!r}")

    def _check_weight_gradients(self) -> None:
        pool = self.weight_gradient_pool
        try:
            WeightGradientFusion(pool=pool)  # the one place that knows which pools are valid
        except ValueError as err:
            raise ValueError(
                f"weight_gradient_pool must be a number of backwards >= 1, 'free' or None, got {pool!r}"
            ) from err
        if isinstance(pool, int) and not self.weight_gradient_fusion:
            raise ValueError(
                f"weight_gradient_pool={pool} pools fused weight gradients, but weight_gradient_fusion is off; "
                "turn fusion on or leave the pool out"
            )

    def _check_run_folder(self) -> None:
        if self.stop_after is not None and not 1 <= self.stop_after <= self.steps:
            raise ValueError(f"stop_after must be in 1..steps={self.steps}, got {self.stop_after}")
        if self.stop_after is not None and self.checkpoint_dir is None:
            raise ValueError(
                f"stop_after={self.stop_after} ends the run to resume it later, but without checkpoint_dir nothing is "
                "saved to resume from; give a checkpoint directory, or fewer steps"
            )
        if self.resume and self.checkpoint_dir is None:
            raise ValueError("resume needs checkpoint_dir: the folder to resume from")

    @property
    def layout(self) -> Layout:
        """The run's ``pp x dp x fsdp x tp`` grid of ranks, with its ``ep``."""
        return Layout(self.pp, self.dp, self.fsdp, self.tp, self.ep)

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    @property
    def batch_shards(self) -> int:
        """Ranks of a stage that each take their own share of the batch: ``dp * fsdp``."""
        return self.layout.batch_shards

    @property
    def tokens_per_sample(self) -> int:
        """Tokens in one sample: the sequence length for a language model, else 1 (a sample counts as one)."""
        return self.seq_len if isinstance(model_of(self.model), (GPTConfig, UserModel)) else 1
