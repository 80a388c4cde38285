"""A Pipeline's assembly: its arguments checked, this rank's stages placed, and their links to the other ranks made."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass

from torch import nn

from stagewise.comm import Layout, PipelineMesh, Transport
from stagewise.partition import Layer, Partition, shared_parameters
from stagewise.pipeline.config import LossFn, PipelineOptions, WeightGradientFusion
from stagewise.pipeline.execution.executor import Executor
from stagewise.pipeline.loss.routing import routed_layers
from stagewise.pipeline.loss.sharing import Sharing
from stagewise.pipeline.parallel.data_parallel import Replicas
from stagewise.pipeline.parallel.expert_parallel import ExpertParallel, expert_parallel
from stagewise.pipeline.parallel.fully_sharded import ShardedStages, fully_sharded, refuse_ties_within_a_rank
from stagewise.pipeline.parallel.tensor_parallel import split_stages
from stagewise.pipeline.parallel.tied_weights import Ties
from stagewise.pipeline.stage.batch_norm import DeferredBatchNorm, StatisticsSource, statistics_source
from stagewise.pipeline.stage.compiled import CompiledGraphs, backend_of
from stagewise.pipeline.stage.held import ModelNames
from stagewise.pipeline.stage.materialise import Materialising, initialiser_of
from stagewise.pipeline.stage.module import StageModule, own_stages
from stagewise.schedule.actions import Schedule
from stagewise.schedule.builders import ScheduleName, build
from stagewise.schedule.validate import validate

log = logging.getLogger(__name__)


def checked_schedule(
    layers: Sequence[Layer],
    partition: Partition,
    schedule: ScheduleName | Schedule,
    n_microbatches: int,
    *,
    loss_fn: LossFn,
    options: PipelineOptions,
) -> Schedule:
    """The validated schedule of a :class:`~stagewise.Pipeline` over ``layers``; its other arguments checked
    against the model and each other (each group of ``options`` checked itself on construction).

    Raises:
        TypeError: an argument of the wrong type (the message names it and what to pass).
        ValueError: a value that cannot run, or two that do not go together.
    """
    if not isinstance(partition, Partition):
        raise TypeError(f"partition must be a stagewise Partition, got {type(partition).__name__}")
    if not isinstance(options, PipelineOptions):
        raise TypeError(f"options must be a stagewise PipelineOptions, got {type(options).__name__}")
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}")
    if partition.n_layers != len(layers):
        raise ValueError(
            f"the partition splits {partition.n_layers} layers but the model has {len(layers)}; "
            "partition this model's layers (stagewise.partition.auto or balance)"
        )
    if isinstance(schedule, Schedule):
        plan = _given(schedule, partition, n_microbatches, options.n_virtual)
    else:
        plan = build(schedule, partition.n_stages, n_microbatches, n_virtual=options.n_virtual or 1)
    validate(plan)
    return plan


def _given(schedule: Schedule, partition: Partition, n_microbatches: int, n_virtual: int | None) -> Schedule:
    """``schedule``, passed in, refused unless it runs ``partition``'s stages, ``n_microbatches`` and ``n_virtual``."""
    if schedule.n_stages != partition.n_stages or schedule.n_microbatches != n_microbatches:
        raise ValueError(
            f"the schedule is for {schedule.n_stages} stages and {schedule.n_microbatches} micro-batches, but the "
            f"partition has {partition.n_stages} stages and n_microbatches is {n_microbatches}"
        )
    if n_virtual is not None and n_virtual != schedule.n_virtual:
        raise ValueError(
            f"PipelineOptions.n_virtual={n_virtual}, but the schedule given has {schedule.n_virtual} stages per "
            f"rank; leave n_virtual out (None: the schedule's own) or pass a schedule built with n_virtual={n_virtual}"
        )
    return schedule


def fusion_in_effect(options: PipelineOptions, layout: Layout) -> WeightGradientFusion | None:
    """``options``' weight-gradient fusion, or None (autograd accumulates) where it is off, where replicas must
    find unused parameters (DDP learns which parameters a replica used from their gradient hooks, which fused
    backwards skip), where parameters are sharded (FSDP's whole parameters and tensor parallelism's DTensors are
    not a fused op's to write) or where layers are compiled (a compiled graph computes its weight gradients
    itself)."""
    fusion = options.fuse_weight_gradients
    if not fusion.enabled:
        return None
    if options.compute.compile:
        log.info("compiled stages: gradient accumulation left to the compiled backward (no fusion)")
        return None
    if fully_sharded(options.fully_sharded, layout) is not None or layout.tp > 1:
        log.info("sharded stages: gradient accumulation left to autograd (no fusion)")
        return None
    if layout.dp > 1 and options.data_parallel.find_unused_parameters:
        log.info("find_unused_parameters: gradient accumulation left to autograd (no fusion)")
        return None
    return fusion


@dataclass(frozen=True)
class Runtime:
    """The parts a :class:`~stagewise.Pipeline` runs on one rank, as :func:`assemble` made them."""

    position: int
    """This rank's place in the pipeline, 0 .. n_ranks - 1."""
    stages: dict[int, StageModule]
    """This rank's stages by their number, materialised on the mesh's device."""
    model_names: ModelNames
    """The unsplit model's names, whichever rank holds what they name."""
    fusion: WeightGradientFusion | None
    """How backwards accumulate the weight gradients of linear layers; None: autograd does."""
    batch_norm: StatisticsSource
    """Which batch moves the running statistics of the model's batch norms (``options.batch_norm`` resolved)."""
    compiled: CompiledGraphs | None
    """The backend compiling every layer, counting its graphs; None: the layers run eagerly."""
    tensor_parallel: list[str]
    """The layers this rank's stages split over the mesh's ``tp`` ranks (see :mod:`.parallel.tensor_parallel`)."""
    sharded: ShardedStages | None
    """This rank's stages sharded by FSDP; None: whole on every rank of a replica."""
    experts: ExpertParallel | None
    """This rank's mixture-of-experts layers with their experts split over ``ep`` ranks; None with ``ep = 1``."""
    ties: Ties
    """The copies of parameters shared with other ranks, kept equal."""
    transport: Transport
    """The activations and gradients between stages, and what one rank tells the others."""
    sharing: Sharing
    """How the ranks of a pipeline learn the loss and the micro-batch count from the one rank that knows it."""
    replicas: Replicas | None
    """The stages wrapped in DDP over their replicas (``dp > 1`` without sharding); None: no replicas."""
    norms: DeferredBatchNorm | None
    """The batch norms whose running statistics move once per step; None: once per micro-batch."""
    executor: Executor
    """What runs this rank's actions of the schedule over the parts above."""

    def close(self, *, wait: bool = True) -> None:
        """Destroy the process groups these parts made: the transport's (after its sends in flight, unless
        ``wait=False``) and the tied copies'."""
        try:
            self.transport.close(wait=wait)
        finally:
            self.ties.close()


@dataclass(frozen=True)
class _Placed:
    """This rank's stages, materialised and split as the mesh says: what :func:`_place` makes."""

    stages: dict[int, StageModule]
    model_names: ModelNames
    fusion: WeightGradientFusion | None
    batch_norm: StatisticsSource
    compiled: CompiledGraphs | None
    tensor_parallel: list[str]
    sharded: ShardedStages | None
    experts: ExpertParallel | None


def assemble(
    model: nn.Module,
    layers: list[Layer],
    partition: Partition,
    schedule: Schedule,
    mesh: PipelineMesh,
    options: PipelineOptions,
    *,
    n_microbatches: int,
) -> Runtime:
    """This rank's :class:`Runtime` of ``model`` (whose chain is ``layers``) split by ``partition`` and run by
    ``schedule`` on ``mesh``: its stages materialised on the mesh's device (and split, sharded as the mesh and
    ``options`` say), its tied copies synchronised, its transport, replicas and executor. Every rank calls it
    (it makes process groups); every wait is bounded by the mesh's timeout. A failure closes what was made.

    Raises:
        ValueError: a mesh that does not run ``schedule`` (its ``pp``), or compiled layers with ``tp > 1``.
    """
    _check_mesh(schedule, mesh, options)
    placed = _place(model, layers, partition, schedule, mesh, options, n_microbatches=n_microbatches)
    timeout = mesh.timeout
    with ExitStack() as undo:  # a failure below closes the groups made so far; then Runtime.close owns them
        ties = Ties(layers, placed.model_names.tied, partition, schedule, mesh, timeout=timeout)
        undo.callback(quietly, ties.close)
        ties.synchronise()
        # A group of its own (collective: every rank builds its Pipeline), so steady streams drop control words.
        # Two streams, activations and gradients (executor.ACTIVATIONS, GRADIENTS); what one rank tells the
        # others (loss_sharing) travels by Transport.broadcast_along, which needs no stream of ours.
        transport = Transport(device=mesh.device, timeout=timeout, dedicated=True, streams=2)
        undo.callback(quietly, transport.close, wait=False)
        replicas = None
        if mesh.layout.dp > 1 and placed.sharded is None:
            replicas = Replicas(
                placed.stages, group=mesh.dp_group, device=mesh.device, config=options.data_parallel, timeout=timeout,
                ignored=_split_experts(placed),
            )  # fmt: skip
        norms = _deferred_norms(placed, mesh)
        position = mesh.stage
        executor = Executor(
            schedule, position, placed.stages, transport, mesh.layout.pipeline_ranks(mesh.line),
            replicas=replicas if replicas is not None else placed.sharded,  # DDP's replicas, or FSDP's shards
            # DDP and FSDP average over the batch's shares; a sum wants the total, and so does a token mean (divided
            # by the global count already)
            grad_scale=float(mesh.layout.batch_shards) if options.loss.reduction in ("sum", "tokens") else 1.0,
            fusion=placed.fusion,
        )  # fmt: skip
        executor.exchanging = _exchanging(placed, mesh, options)
        undo.pop_all()
    return Runtime(
        position, placed.stages, placed.model_names, placed.fusion, placed.batch_norm, placed.compiled,
        placed.tensor_parallel, placed.sharded, placed.experts, ties, transport, Sharing(mesh, transport, timeout),
        replicas, norms, executor,
    )  # fmt: skip


def _check_mesh(schedule: Schedule, mesh: PipelineMesh, options: PipelineOptions) -> None:
    """Refuse a mesh that does not run ``schedule``, or compiled layers on a mesh that splits them."""
    if mesh.layout.pp != schedule.n_ranks:
        raise ValueError(
            f"the schedule runs on {schedule.n_ranks} pipeline ranks ({schedule.n_stages} stages, "
            f"{schedule.n_virtual} per rank) but the mesh has pp={mesh.layout.pp}"
        )
    if options.compute.compile and mesh.layout.tp > 1:
        raise ValueError(
            f"Compute.compile with tp={mesh.layout.tp}: the tensor-parallel split turns the layers' "
            "parameters into DTensors after they are compiled, which stagewise does not compile through; "
            "compile with tp=1 (fsdp and dp may be above 1), or leave compile off"
        )


def _place(
    model: nn.Module,
    layers: list[Layer],
    partition: Partition,
    schedule: Schedule,
    mesh: PipelineMesh,
    options: PipelineOptions,
    *,
    n_microbatches: int,
) -> _Placed:
    """Materialise this rank's stages on the mesh's device, then split and shard them as the mesh says."""
    fusion = fusion_in_effect(options, mesh.layout)
    shared = shared_parameters(layers)  # before materialising, which unties them
    sharding = fully_sharded(options.fully_sharded, mesh.layout)
    if sharding is not None:  # on every rank alike, before anything is materialised
        refuse_ties_within_a_rank(shared, partition.bounds, schedule)
    keys = frozenset(layer.qualify(k) for layer in layers for k in layer.module.state_dict())
    backend = backend_of(options.compute.compile)
    compiled = None if backend is None else CompiledGraphs(backend)
    stages = own_stages(
        layers, partition.bounds, schedule.stages_of(mesh.stage), shared,
        making=Materialising(mesh.device, options.seed, initialiser_of(model, options.init)),
        compute=options.compute, fusion=fusion, compiled=compiled,
    )  # fmt: skip
    batch_norm = statistics_source(options.batch_norm, layers, n_microbatches)
    split = split_stages(stages, layers, shared, mesh, options, model) if mesh.layout.tp > 1 else []
    experts = expert_parallel(stages, mesh)
    ignored = None if experts is None else set(experts.parameters)
    sharded = None if sharding is None else ShardedStages.over(stages, mesh, sharding, ignored=ignored)
    names = ModelNames(keys, tuple(shared))
    return _Placed(stages, names, fusion, batch_norm, compiled, split, sharded, experts)


def _exchanging(placed: _Placed, mesh: PipelineMesh, options: PipelineOptions) -> frozenset[int]:
    """The stages whose forwards and backwards run in pairs, overlapping their all-to-alls (see
    :mod:`.execution.pairs`): those with split experts, unless ``tp > 1`` (both would use its group) or the option
    is off."""
    if placed.experts is None or mesh.layout.tp > 1 or not options.compute.overlap_all_to_all:
        return frozenset()
    return frozenset(s for s, stage in placed.stages.items() if routed_layers(stage.layers))


def _split_experts(placed: _Placed) -> set[nn.Parameter] | None:
    """The experts' parameters that expert parallelism split, which data parallelism leaves alone."""
    return None if placed.experts is None else set(placed.experts.parameters)


def _deferred_norms(placed: _Placed, mesh: PipelineMesh) -> DeferredBatchNorm | None:
    """The batch norms of ``placed`` stages whose running statistics move once per step, over the replicas'
    batches too for "global-batch"; None where every micro-batch moves them."""
    if placed.batch_norm == "micro-batch":
        return None
    global_batch = placed.batch_norm == "global-batch" and mesh.layout.batch_shards > 1
    norms = DeferredBatchNorm(placed.stages, group=mesh.batch_group if global_batch else None, timeout=mesh.timeout)
    for s, stage_norms in norms.stages.items():
        placed.stages[s].batch_norms = stage_norms
    log.info("the batch norms of stages %s move their statistics once per step", list(norms.stages))
    return norms


def quietly(close: Callable[..., None], **options: bool) -> None:
    """Close something a failed assembly made, keeping the assembly's error the one raised."""
    try:
        close(**options)
    except Exception as err:
        log.warning("closing after a failed Pipeline construction failed too: %s", err)
