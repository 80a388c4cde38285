"""Every option of a Pipeline: the types of its settings and the groups of its rarer knobs, each checked when made."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, get_args

import torch
from torch import nn

from stagewise.comm.payload import Payload
from stagewise.errors import is_whole, whole_number
from stagewise.partition.linears import DEFAULT_MIN_POOLED_ELEMENTS

if TYPE_CHECKING:
    from torch.distributed.tensor.parallel import ParallelStyle

LossFn = Callable[[Payload, Payload], torch.Tensor]
"""``loss_fn(output, target)`` for one micro-batch: a scalar tensor."""

LossReduction = Literal["mean", "sum", "tokens"]
"""How ``loss_fn`` reduces over a batch: the mean or the sum over its samples, or the sum over its tokens, which
the pipeline divides by the global batch's valid tokens (see :mod:`stagewise.pipeline.loss.tokens`)."""

NonFinite = Literal["raise", "skip"]
"""What :meth:`stagewise.Pipeline.step` does when the loss is NaN or infinite."""

BatchNormStatistics = Literal["auto", "micro-batch", "batch", "global-batch"]
"""Which batch moves the running statistics of batch norms in training (see ``PipelineOptions.batch_norm``)."""

Initialiser = Callable[[nn.Module], None]
"""``init(module)``: give ``module``'s own parameters and buffers (not its children's) their initial values, as
a Hugging Face model's ``_init_weights`` does; it is called for every module to initialise, children first, under
a generator seeded from ``(seed, layer)``."""

TensorParallelPlan = Callable[[str, nn.Module, int], "Mapping[str, ParallelStyle] | ParallelStyle | None"]
"""``plan(name, module, tp)``: how to split the layer ``name`` (as :func:`~stagewise.partition.layers_of` names
it: ``blocks.3``) over ``tp`` ranks, as ``parallelize_module`` takes it: a style for the layer's ``module``
itself, or submodule names relative to it mapped to styles (torch's ``ColwiseParallel``, ``RowwiseParallel``,
...); None leaves the layer whole on every ``tp`` rank (replicated: each computes the same). A plan that cannot
split the layer over ``tp`` ranks raises ``ValueError`` saying what would fit. The layers' outputs must be whole
(replicated) tensors, as a row-wise split's are, since they travel to the next stage as they are."""

TensorParallelStyle = Literal[
    "colwise", "rowwise", "replicate", "colwise_rep", "colwise_gather_output", "rowwise_rep", "rowwise_split_input",
    "embedding_rowwise", "embedding_colwise", "replicated_with_grad_allreduce",
]  # fmt: skip
"""How a path-keyed plan splits a module's parameters over the ``tp`` ranks, by the names Hugging Face's
``tp_plan`` uses. "colwise": a linear layer's output features (``nn.Linear``'s weight by rows and its bias; GPT-2's
``Conv1D``, whose weight is stored ``[in, out]``, by columns), an embedding's features. "rowwise": a linear layer's
input features (the bias stays whole), an embedding's rows (the vocabulary). "replicate": whole on every rank.
"colwise_rep" and "colwise_gather_output" split as "colwise", "rowwise_rep" and "rowwise_split_input" as "rowwise",
"embedding_rowwise" as "rowwise", "embedding_colwise" as "colwise", "replicated_with_grad_allreduce" as "replicate"
(Hugging Face's variants differ in where the activations are gathered, which stagewise leaves to DTensor)."""

TensorParallelPaths = Mapping[str, TensorParallelStyle]
"""A plan keyed by path: parameter or module names of the unsplit model (``*`` stands for any one dotted
component, as in Hugging Face's ``tp_plan``: ``"model.layers.*.self_attn.q_proj"``) to a
:data:`TensorParallelStyle`. A module's key applies to its own parameters (``weight``, ``bias``); a parameter's key
to that parameter, before its module's. Every key must name something in the model."""

CheckpointingPolicy = Callable[[str], "bool | SelectiveCheckpointing"]
"""``policy(layer)``: what the layer named ``layer`` (``"blocks.3"``) recomputes in backward: False (nothing), True
(its whole forward) or a :class:`SelectiveCheckpointing`."""

CommHook = Callable[[Any, Any], torch.futures.Future[torch.Tensor]]
"""A DDP communication hook: ``hook(state, bucket)`` returns a future of the reduced bucket."""


@dataclass(frozen=True)
class Loss:
    """How the micro-batches' losses make the batch's, and what a step does when that loss is not finite."""

    reduction: LossReduction = "mean"
    """How ``loss_fn`` reduces over a batch: "mean" (torch's losses' default) weights each micro-batch's loss by
    its share of the batch; "sum" adds them; "tokens" takes the mean over the valid target tokens of the global
    batch, as Hugging Face's language-model losses do on padded batches: ``loss_fn`` returns the *sum* of its
    micro-batch's per-token losses (e.g. ``F.cross_entropy(logits.flatten(0, 1), targets.flatten(),
    ignore_index=-100, reduction="sum")``), and each sum is divided by the count of targets other than
    ``ignore_index`` over every micro-batch of every replica (of the first tensor, where the targets are a tuple).
    Replicas' batches may then differ in size; a global batch without valid tokens is refused on every rank."""
    ignore_index: int = -100
    """With ``reduction="tokens"``: the target value that marks a position no loss counts (padding), as
    ``ignore_index`` does in ``F.cross_entropy`` (whose default, and Hugging Face's, is -100); unused otherwise."""
    shift_labels: bool = False
    """With ``reduction="tokens"``: the targets are Hugging Face's labels, the inputs themselves
    (``labels = input_ids``), which ``loss_fn`` shifts by one inside (as ``ForCausalLMLoss`` does), so the first
    target of each sample predicts nothing and the count leaves it out. False: the targets are given shifted
    (each position's next token), and every one other than ``ignore_index`` counts."""
    nonfinite: NonFinite = "raise"
    """When the loss is NaN or infinite: "raise" :class:`~stagewise.pipeline.NonFiniteLossError` naming the step
    and micro-batch (on every rank), or "skip" the step: its gradients are dropped (those accumulated over earlier
    steps are kept, from a copy taken at the start of each step that finds some; with none, ``.grad`` is None, so
    the optimizer's step changes nothing) and ``Pipeline.skipped`` is True."""

    def __post_init__(self) -> None:
        if self.reduction not in get_args(LossReduction):
            raise ValueError(
                f"Loss.reduction must be 'mean', 'sum' or 'tokens', got {self.reduction!r}; "
                "'tokens' is the mean over the valid target tokens of a padded batch"
            )
        whole_number("Loss.ignore_index", self.ignore_index)
        if not isinstance(self.shift_labels, bool):
            raise TypeError(f"Loss.shift_labels must be True or False, got {self.shift_labels!r}")
        if self.nonfinite not in get_args(NonFinite):
            raise ValueError(f"Loss.nonfinite must be 'raise' or 'skip', got {self.nonfinite!r}")


DEFAULT_MIN_ELEMENTS = 1 << 20
"""Weights smaller than this (4 MiB in fp32) are left to autograd when each backward accumulates its own.

Their gradients stay in cache, where autograd's separate addition costs less
than the Python overhead of the fused backward. Measured on a 2-core CPU,
one process, 8 micro-batches of 8 rows through residual-MLP blocks: fusing
every weight took 0.72-0.80x autograd's step time with 4M-element weights,
1.09-1.23x with 262k-element ones.
"""


@dataclass(frozen=True)
class WeightGradientFusion:
    """How :class:`stagewise.Pipeline` accumulates the weight gradients of linear layers over micro-batches.

    Each backward either adds its weight gradients into ``.grad`` itself
    (fused: one GEMM per micro-batch that writes into ``.grad``), or leaves
    them to a ``WeightGradientStore`` (:mod:`stagewise.pipeline.backward.fusion`) so that ``pool`` backwards' are
    summed by one GEMM per weight (pooled). Weights below the size thresholds
    are left to autograd.
    """

    min_elements: int = DEFAULT_MIN_ELEMENTS
    """Fuse the linear weights of at least this many elements, when each backward accumulates its own."""
    min_pooled_elements: int = DEFAULT_MIN_POOLED_ELEMENTS
    """Fuse the linear weights of at least this many elements, when backwards pool their weight gradients."""
    pool: int | Literal["free"] | None = "free"
    """How many consecutive backwards of a rank pool their weight gradients into one GEMM per weight.

    A pool of k > 1 keeps each fused linear's input and output gradient for up
    to k backwards: less memory traffic where weights are large, more memory
    held, about one micro-batch's activations per pooled backward. "free"
    (the default) chooses, per rank, the largest pool that keeps what the rank
    holds within what the pipeline's fullest rank holds in flight anyway
    (:func:`stagewise.schedule.free_pool`): the whole step for GPipe; under
    1F1B over p ranks, r + 1 on rank r, so the first rank pools nothing and
    the others fill up to its p micro-batches. The planner and
    ``stagewise.partition.memory_model`` count this (``stagewise.schedule.holdings``);
    with activation checkpointing "free" pools nothing, since a pooled
    backward would keep more than the checkpointed forward did. None keeps
    each stage within its own micro-batches in flight: all of a step's where
    every forward of a stage runs before its first backward (GPipe),
    otherwise 1 (nothing pooled). A split backward (zero-bubble) pools
    nothing: each micro-batch's W adds what its I left.
    """
    enabled: bool = True
    """Whether backwards fuse at all; False (:meth:`off`) leaves the accumulation of every gradient to autograd."""

    def __post_init__(self) -> None:
        for name in ("min_elements", "min_pooled_elements"):
            value = getattr(self, name)
            if not is_whole(value) or value < 0:
                raise ValueError(
                    f"WeightGradientFusion.{name} must be a number of elements >= 0, got {value!r}; "
                    "0 fuses every linear weight"
                )
        if not isinstance(self.enabled, bool):
            raise TypeError(f"WeightGradientFusion.enabled must be True or False, got {self.enabled!r}")
        pool = self.pool
        if pool is not None and pool != "free" and (not is_whole(pool) or pool < 1):
            raise ValueError(
                f"WeightGradientFusion.pool must be a number of backwards >= 1, 'free' or None, got {pool!r}; "
                "1 pools nothing, None lets the schedule choose, 'free' pools what fits in the pipeline's peak"
            )

    @classmethod
    def every(cls, pool: int | Literal["free"] | None = "free") -> WeightGradientFusion:
        """Fuse every linear weight, whatever its size, pooling as ``pool`` says (the default's by default)."""
        return cls(min_elements=0, min_pooled_elements=0, pool=pool)

    @classmethod
    def off(cls) -> WeightGradientFusion:
        """No fusion: autograd accumulates every weight gradient, and hooks on a parameter's gradient accumulator
        see every backward; nothing is pooled (``pool=1``, as :func:`stagewise.schedule.holdings` counts it)."""
        return cls(enabled=False, pool=1)

    def threshold(self, *, pooled: bool) -> int:
        """The smallest weight to fuse, with or without pooling."""
        return self.min_pooled_elements if pooled else self.min_elements


@dataclass(frozen=True)
class DataParallel:
    """How the replicas of a stage synchronise their gradients: the DistributedDataParallel options that matter.

    Used by :class:`stagewise.Pipeline` when its mesh has ``dp > 1``.
    """

    bucket_cap_mb: float = 25.0
    """Gradients are all-reduced in buckets of about this many MiB, each as soon as it is complete."""
    gradient_as_bucket_view: bool = False
    """Make each ``.grad`` a view into its all-reduce bucket: one copy of the gradients less in memory."""
    find_unused_parameters: bool = False
    """Search each stage's graph for parameters that get no gradient (needed when some are unused). Turns
    ``Pipeline``'s weight-gradient fusion off: DDP learns which parameters a replica used from the gradient hooks
    that a fused backward skips."""
    comm_hook: CommHook | None = None
    """A DDP communication hook, e.g. ``bf16_compress_hook`` from ``torch.distributed.algorithms.ddp_comm_hooks``."""
    comm_state: object = None
    """The state passed to ``comm_hook``; by default the stage's data-parallel group, as torch's default hooks take."""

    def __post_init__(self) -> None:
        if not self.bucket_cap_mb > 0:
            raise ValueError(f"bucket_cap_mb must be positive, got {self.bucket_cap_mb}")
        if self.comm_hook is not None and not callable(self.comm_hook):
            raise TypeError(f"comm_hook must be callable, got {type(self.comm_hook).__name__}")


GatherWhen = Literal["step", "micro-batch"]
"""When FSDP gathers a stage's whole parameters (see :attr:`FullySharded.gather`)."""


@dataclass(frozen=True)
class FullySharded:
    """How each stage's parameters are sharded over the mesh's ``fsdp`` ranks (torch's ``fully_shard``, FSDP2).

    Used by :class:`stagewise.Pipeline` when its mesh has ``fsdp > 1`` (and ``dp > 1`` with it: HSDP, sharded
    within a replica and all-reduced across replicas), or ``tp > 1`` with ``dp > 1``; passed with ``fsdp == 1``
    the stages are wrapped all the same (one rank's mixed precision through FSDP's policy). Each stage is one
    FSDP unit. By default (``gather="step"``) its parameters are all-gathered once per step, before its first
    forward, and stay whole until the step's end, when the gradients accumulated over every micro-batch are
    reduce-scattered once; with ``gather="micro-batch"`` they are gathered around each of the stage's actions
    and its gradients reduce-scattered after each backward (ZeRO-3 inside the pipeline). Between steps a rank
    holds ``1/fsdp`` of its stages' parameters, gradients and optimizer state; ``offload`` keeps those in host
    memory.
    """

    param_dtype: torch.dtype | None = None
    """The dtype the stages compute in (their parameters are all-gathered in it, e.g. ``torch.bfloat16``); the
    sharded parameters, which the optimizer steps, keep theirs (fp32 master weights). None: their own dtype."""
    reduce_dtype: torch.dtype | None = None
    """The dtype gradients are accumulated and reduce-scattered in (e.g. ``torch.float32`` with bf16
    parameters); None: ``param_dtype``."""
    gather: GatherWhen = "step"
    """When a stage's whole parameters exist. "step": from before the step's first action to its end, with the
    step's whole gradients (one all-gather and one reduce-scatter per stage and step). "micro-batch": only
    around the stage's actions (from its action to the next action of another stage of the rank), the next
    action's stage gathered as soon as the last is freed, and the gradients reduce-scattered into the sharded
    ``.grad`` after each backward (B, or W of a split backward): a rank holds at most one stage's whole
    parameters and gradients at a time, at the cost of an all-gather per run of a stage's actions and a
    reduce-scatter per backward (see :mod:`stagewise.pipeline.parallel.fully_sharded`)."""
    offload: bool = False
    """Keep the sharded parameters (the fp32 master weights), their gradients and so the optimizer state in
    host memory (FSDP's ``CPUOffloadPolicy``, pinned on an accelerator): the optimizer steps on the host, and
    each gather copies the shards to the device first. On a CPU mesh everything is in host memory already and
    nothing moves."""

    def __post_init__(self) -> None:
        for name in ("param_dtype", "reduce_dtype"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, torch.dtype) and value.is_floating_point):
                raise TypeError(f"FullySharded.{name} must be a floating torch.dtype or None, got {value!r}")
        if self.gather not in get_args(GatherWhen):
            raise ValueError(
                f"FullySharded.gather must be 'step' or 'micro-batch', got {self.gather!r}; 'micro-batch' frees "
                "each stage's whole parameters between its actions"
            )
        if not isinstance(self.offload, bool):
            raise TypeError(f"FullySharded.offload must be True or False, got {self.offload!r}")


MATMULS: frozenset[str] = frozenset(
    {
        "aten.mm.default",
        "aten.addmm.default",
        "aten.bmm.default",
        "aten.baddbmm.default",
        "aten._scaled_dot_product_flash_attention_for_cpu.default",
        "aten._scaled_dot_product_flash_attention.default",
        "aten._scaled_dot_product_efficient_attention.default",
        "aten._scaled_dot_product_cudnn_attention.default",
    }
)
"""The ops whose outputs :class:`SelectiveCheckpointing` keeps by default: matrix multiplications and fused
attention, the costliest to recompute for the bytes they save."""


@dataclass(frozen=True)
class SelectiveCheckpointing:
    """Recompute each layer's forward in backward except the outputs of the ops ``keep`` chooses (torch's selective
    activation checkpointing, ``create_selective_checkpoint_contexts``): by default the matmuls' and attention's
    outputs are kept and the cheap elementwise ops (norms, activations, additions) recomputed."""

    keep: frozenset[str] | Callable[[Any], bool] = MATMULS
    """The aten ops whose outputs are saved, by name (``"aten.mm.default"``), or a function of the op (a
    ``torch._ops.OpOverload``) that says whether to save its output; every other op is recomputed."""

    def __post_init__(self) -> None:
        if not callable(self.keep) and not (
            isinstance(self.keep, frozenset) and all(isinstance(name, str) for name in self.keep)
        ):
            raise TypeError(
                f"SelectiveCheckpointing.keep must be a frozenset of op names (such as 'aten.mm.default') or a "
                f"function of the op, got {self.keep!r}"
            )

    def saves(self, op: Any) -> bool:
        """Whether the output of ``op`` is kept rather than recomputed."""
        return bool(self.keep(op)) if callable(self.keep) else str(op) in self.keep


@dataclass(frozen=True)
class Compute:
    """How every stage runs its forward: in which precision, and what it keeps for its backward."""

    autocast: torch.dtype | None = None
    """Run every stage's forward under ``torch.autocast`` with this dtype (e.g. ``torch.bfloat16``); None: the
    model's own dtypes."""
    activation_checkpointing: bool | SelectiveCheckpointing | CheckpointingPolicy = False
    """Recompute each layer's forward during backward instead of keeping its activations (less memory, one more
    forward); a :class:`SelectiveCheckpointing` keeps the outputs of the ops it names (by default the matmuls) and
    recomputes the rest; a function of the layer's name (``"blocks.3"``, as :func:`~stagewise.partition.layers_of`
    names it) chooses per layer (a :data:`CheckpointingPolicy`: keep the embedding's activations, recompute the
    blocks'; per stage, from the partition's bounds). Under a split backward (zero-bubble, ZBV, DualPipeV) I and W
    are two backwards, and each recomputes what it needs of the forward: W's recomputation is the elementwise ops
    that feed the weights' matmuls under the default selective policy, the whole layer's forward under full
    checkpointing. W then passes the gradient back through the recomputed layer again (the gradients I found
    went with I's graph), so a checkpointed layer's W costs about a whole backward."""
    offload_activations: bool = False
    """Keep the activations each stage saves for its backward in host memory: each is copied there during the
    forward (on a stream of its own, overlapped with compute, on a CUDA device) and back when the backward needs it,
    so a rank's device holds about one micro-batch's activations instead of every one in flight. Parameters and
    tensors under 1 MiB stay on the device. On a CPU device the activations are in host memory already, and nothing
    moves."""
    compile: bool | str = False
    """Compile each layer's forward with ``torch.compile`` (its backward through AOTAutograd): True uses the
    ``"inductor"`` backend, a string names another (``"aot_eager"``, ...). Layers of one class share their graphs,
    and equal shapes compile nothing after the first step (``Pipeline.compiled_graphs`` counts them). A compiled
    layer's backward is one graph: under a split backward (zero-bubble) I computes its weight gradients too, and
    W has none left to fill the bubble with."""
    overlap_all_to_all: bool = False
    """Where a rank's schedule runs a forward and then a whole backward of another stage (DualPipeV's steady
    state) and their stages exchange tokens by all-to-all (expert parallelism), run the two at once, the backward
    in a thread of its own, so that one's all-to-all overlaps the other's compute (see
    :mod:`stagewise.pipeline.execution.pairs`); False: one action at a time. Off by default: where the cores are
    busy already (more processes than cores, as benchmarks/moe_overlap.py measures on a laptop) the second thread
    only competes for them."""

    def __post_init__(self) -> None:
        if self.autocast is not None and not isinstance(self.autocast, torch.dtype):
            raise TypeError(
                f"Compute.autocast must be a torch.dtype or None, got {self.autocast!r}; e.g. torch.bfloat16"
            )
        if not isinstance(self.activation_checkpointing, bool | SelectiveCheckpointing) and not callable(
            self.activation_checkpointing
        ):
            raise TypeError(
                f"Compute.activation_checkpointing must be True, False, a SelectiveCheckpointing or a function of "
                f"the layer's name returning one of those, got {self.activation_checkpointing!r}"
            )
        if not isinstance(self.offload_activations, bool):
            raise TypeError(f"Compute.offload_activations must be True or False, got {self.offload_activations!r}")
        if not isinstance(self.compile, bool | str) or self.compile == "":
            raise TypeError(
                f"Compute.compile must be True, False or a torch.compile backend's name, got {self.compile!r}"
            )
        if isinstance(self.compile, str) and self.compile not in (known := torch._dynamo.list_backends(())):
            raise ValueError(f"Compute.compile names no torch.compile backend: {self.compile!r}; choose among {known}")

    def checkpointing_of(self, layer: str) -> bool | SelectiveCheckpointing:
        """What layer ``layer`` recomputes in backward: nothing (False), its whole forward (True), or the ops a
        :class:`SelectiveCheckpointing` does not keep.

        Raises:
            TypeError: a per-layer policy that returns something else for ``layer``.
        """
        policy = self.activation_checkpointing
        if isinstance(policy, bool | SelectiveCheckpointing):
            return policy
        chosen = policy(layer)
        if not isinstance(chosen, bool | SelectiveCheckpointing):
            raise TypeError(
                f"Compute.activation_checkpointing({layer!r}) returned {chosen!r}; a per-layer policy returns "
                "True, False or a SelectiveCheckpointing for every layer"
            )
        return chosen


@dataclass(frozen=True)
class Diagnostics:
    """What a step records of itself."""

    chrome_trace: str | Path | None = None
    """Write a Chrome/Perfetto trace of each step here (one file per rank, ``.rank{N}`` added before the suffix);
    None writes none. (A trace of the executed actions, not a torch.export capture of the model.)"""

    def __post_init__(self) -> None:
        if self.chrome_trace is not None and not isinstance(self.chrome_trace, str | Path):
            raise TypeError(
                f"Diagnostics.chrome_trace must be a path (str or pathlib.Path) or None, got {self.chrome_trace!r}"
            )


@dataclass(frozen=True)
class PipelineOptions:
    """The rarer knobs of a :class:`~stagewise.Pipeline`, grouped by what they are about; the defaults suit
    most runs, so the common call passes none: ``Pipeline(..., options=PipelineOptions(seed=7))``."""

    n_virtual: int | None = None
    """Stages per rank (interleaved schedules): ``partition.n_stages`` must be ``n_ranks * n_virtual``. None: the
    schedule's own (a named schedule is built with 1, a :class:`~stagewise.schedule.Schedule` passed in has its
    own); a number given with a ``Schedule`` must be the schedule's."""
    seed: int = 0
    """The seed of layer initialisation for layers on the meta device (layer i from ``(seed, i)``)."""
    init: Initialiser | None = None
    """How layers on the meta device are initialised: a callable that gives one module's own tensors their values
    (see :data:`Initialiser`); None: the model's own initialiser where it has one (a Hugging Face model's
    ``_init_weights``), else each module's ``reset_parameters``."""
    loss: Loss = field(default_factory=Loss)
    """How the micro-batches' losses make the batch's (mean, sum or token mean, the padding's ``ignore_index``,
    Hugging Face's shifted labels), and what a non-finite loss does."""
    compute: Compute = field(default_factory=Compute)
    """Precision and recomputation of the stages' forwards."""
    diagnostics: Diagnostics = field(default_factory=Diagnostics)
    """The Chrome trace of each step."""
    fuse_weight_gradients: WeightGradientFusion = field(default_factory=WeightGradientFusion)
    """How backwards accumulate the gradients of large linear weights (:class:`WeightGradientFusion`): straight
    into ``.grad`` (one GEMM per micro-batch, not a GEMM into a new tensor and then an addition), as Megatron-LM's
    gradient-accumulation fusion does, or pooled over several backwards into one GEMM per weight (by default each
    rank pools what fits in the pipeline's peak in flight: GPipe a whole step, 1F1B r + 1 backwards on rank r;
    zero-bubble's W adds each micro-batch's). ``WeightGradientFusion.off()`` leaves accumulation to autograd.
    Hooks on a parameter's gradient accumulator see only the backwards not fused (with ``dp > 1``, each stage's
    last of a step, which DDP all-reduces); pass ``WeightGradientFusion.off()`` if they must see every
    micro-batch. With ``DataParallel(find_unused_parameters=True)``, sharded stages or compiled layers there is no
    fusion: DDP learns from those hooks which parameters each replica used."""
    data_parallel: DataParallel = field(default_factory=DataParallel)
    """DDP's options for the replicas of each stage, used when the mesh has ``dp > 1`` (and no sharding)."""
    fully_sharded: FullySharded | Literal["auto"] = "auto"
    """How stages are sharded over the mesh's ``fsdp`` ranks: "auto" shards them with ``FullySharded()`` where
    the mesh does (``fsdp > 1``, or ``tp > 1`` with ``dp > 1``), else not at all; a :class:`FullySharded` wraps
    them so on any mesh."""
    tensor_parallel: TensorParallelPlan | TensorParallelPaths | Literal["model"] | None = None
    """Which modules of each layer are split over the mesh's ``tp`` ranks, and how: a
    :data:`~stagewise.pipeline.TensorParallelPlan` (a function of each layer's module, e.g.
    :func:`stagewise.models.gpt_parallel.plan` for stagewise's GPT); a :data:`TensorParallelPaths` mapping of
    parameter or module paths of the unsplit model to styles (``{"model.layers.*.mlp.up_proj": "colwise", ...}``),
    which splits captured models (Hugging Face's) too; or "model": the Hugging Face model's own ``tp_plan`` (its
    config's ``base_model_tp_plan`` and its head's). Needed when the mesh has ``tp > 1``; None: no plan."""
    batch_norm: BatchNormStatistics = "auto"
    """Which batch moves the running statistics (``running_mean``, ``running_var``, ``num_batches_tracked``)
    of the model's batch norms (every ``torch.nn.modules.batchnorm._BatchNorm`` that tracks them) in training.
    Each micro-batch is normalised with its own statistics whatever this says, as with gradient accumulation.
    "micro-batch": every micro-batch's forward moves them, ``n_microbatches`` times a step. "batch": once per
    step, from the whole batch of this replica (the micro-batches' per-channel counts, sums and sums of
    squares, added in float64), as one training forward of each batch norm on its inputs of the whole batch
    would move them (by momentum, or the cumulative average when it is None; the unbiased variance).
    "global-batch": the same over the global batch, the sums all-reduced over each stage's replicas (as
    SyncBatchNorm's running statistics; "batch" when ``dp == 1``), so replicas keep equal statistics.
    "auto" (the default): "batch" when the model has such batch norms and ``n_microbatches > 1``, else
    "micro-batch". Under "batch" and "global-batch", a skipped or failed step, ``evaluate`` and ``predict``
    move none of them. Captured models (:func:`~stagewise.partition.capture`) defer them too where
    torch.export keeps ``aten.batch_norm`` in the graph; one that updates them inside
    ``_native_batch_norm_legit`` ops (older torch) is refused, and "auto" is then "micro-batch"."""

    def __post_init__(self) -> None:
        if self.n_virtual is not None:
            whole_number("PipelineOptions.n_virtual", self.n_virtual, least=1)
        whole_number("PipelineOptions.seed", self.seed)
        for name, kind in (("loss", Loss), ("compute", Compute), ("diagnostics", Diagnostics)):
            _instance(name, getattr(self, name), kind)
        if not isinstance(self.fuse_weight_gradients, WeightGradientFusion):
            raise TypeError(
                f"PipelineOptions.fuse_weight_gradients must be a WeightGradientFusion, got "
                f"{self.fuse_weight_gradients!r}; e.g. WeightGradientFusion.every() to fuse every linear weight, "
                "or WeightGradientFusion.off() to leave gradient accumulation to autograd"
            )
        _instance("data_parallel", self.data_parallel, DataParallel)
        if self.fully_sharded != "auto" and not isinstance(self.fully_sharded, FullySharded):
            raise TypeError(
                f"PipelineOptions.fully_sharded must be 'auto' or a stagewise FullySharded, got "
                f"{self.fully_sharded!r}; pass FullySharded(...) to shard the stages on any mesh, or 'auto' to "
                "shard them where the mesh has fsdp > 1"
            )
        _check_tensor_parallel(self.tensor_parallel)
        if self.batch_norm not in (choices := get_args(BatchNormStatistics)):
            raise ValueError(
                f"PipelineOptions.batch_norm must be one of {', '.join(map(repr, choices))}, got {self.batch_norm!r}"
            )


def _check_tensor_parallel(plan: object) -> None:
    """Refuse a ``PipelineOptions.tensor_parallel`` that is no plan: not callable, a mapping, "model" or None, a
    mapping with a key that is no path, or a style stagewise does not take."""
    if plan is None or plan == "model" or (callable(plan) and not isinstance(plan, Mapping)):
        return
    if not isinstance(plan, Mapping):
        raise TypeError(
            f"PipelineOptions.tensor_parallel must be callable (a layer's module to its plan), a mapping of "
            f"parameter or module paths to styles, 'model' or None, got {plan!r}"
        )
    accepted = get_args(TensorParallelStyle)
    for key, style in plan.items():
        if not isinstance(key, str) or not key or any(not part for part in key.split(".")):
            raise TypeError(
                f"PipelineOptions.tensor_parallel's keys must be dotted paths such as 'model.layers.*.mlp.up_proj', "
                f"got {key!r}"
            )
        if style not in accepted:
            raise ValueError(
                f"PipelineOptions.tensor_parallel maps {key!r} to {style!r}, which stagewise does not take; "
                f"use one of {', '.join(map(repr, accepted))}"
            )


def _instance(name: str, value: object, kind: type) -> None:
    if not isinstance(value, kind):
        raise TypeError(
            f"PipelineOptions.{name} must be a stagewise {kind.__name__}, got {type(value).__name__}; "
            f"pass {kind.__name__}(...) from stagewise.pipeline"
        )
