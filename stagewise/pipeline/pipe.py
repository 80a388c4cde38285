"""Pipeline: a partitioned model trained across ranks, equal to the unsplit model."""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path

import torch
from torch import nn

from stagewise.comm import PipelineMesh, init_mesh
from stagewise.comm.default_group import world_group
from stagewise.comm.payload import Payload, as_tensors
from stagewise.partition import CapturedChain, Partition, layers_of
from stagewise.partition.call_spec import CallSpec, Inputs, as_positional
from stagewise.pipeline.assembly import Runtime, assemble, checked_schedule, quietly
from stagewise.pipeline.backward.clip import Counting, clip_grad_norm_, held_copies
from stagewise.pipeline.config import LossFn, PipelineOptions
from stagewise.pipeline.execution.executor import StepResult
from stagewise.pipeline.loss.microbatch import Microbatches, batch_size, concat, split
from stagewise.pipeline.loss.nonfinite import EarlierGradients, first_non_finite, skipped_step
from stagewise.pipeline.loss.routing import RoutingLosses, routed_layers
from stagewise.pipeline.loss.sharing import share_count, share_loss
from stagewise.pipeline.loss.tokens import check_tokens, global_tokens, per_token, valid_tokens
from stagewise.pipeline.parallel.tensor_parallel import placed_like_parameters
from stagewise.pipeline.stage.held import HeldStages
from stagewise.schedule.actions import Action, Kind, Schedule
from stagewise.schedule.builders import ScheduleName
from stagewise.schedule.render import to_chrome_trace

log = logging.getLogger(__name__)


class Pipeline(HeldStages):
    """A chain model split by ``partition`` and trained with ``schedule`` across the ranks of a pipeline.

    Each rank materialises only the layers of its own stages: rank ``r`` of
    ``p`` holds stages ``r, r + p, ...`` (more than one with ``n_virtual > 1``).
    A layer on the meta device is allocated on the mesh's device and initialised from
    ``(seed, layer index)`` alone, so the same seed gives the same model for
    any split; a layer with real weights keeps them. Other ranks' layers are
    never touched.

    ``step(inputs, targets)`` cuts the global batch into ``n_microbatches``
    (sizes may differ by one), runs this rank's actions of the schedule and
    leaves this rank's parameter gradients in ``.grad``, accumulated like
    ``loss.backward()``. The gradients and the returned loss equal those of
    ``loss_fn(model(inputs), targets)`` on the whole batch in one process:
    with ``Loss(reduction="mean")`` (a loss averaged over the batch, the
    default of torch's losses) each micro-batch's loss is weighted by its
    share of the batch, ``size / batch``; with ``"sum"`` the losses are added;
    with ``"tokens"`` ``loss_fn`` sums its micro-batch's per-token losses and
    each sum is divided by the valid target tokens of the global batch (see
    :attr:`Loss.reduction`), Hugging Face's mean over the
    tokens of a padded batch.

    With a mesh of ``dp > 1`` the model is trained by ``dp`` pipelines at
    once, each on its own batch (``step`` takes this replica's share of the
    global batch), and each stage's replicas are wrapped in torch's
    DistributedDataParallel over their data-parallel group: gradients are
    all-reduced once per step, during the backward that completes them, and
    the result equals one process on the concatenated global batch. For a
    mean loss every replica's batch must have the same size (see
    :class:`stagewise.pipeline.StageLoader`); a sum or a token mean takes
    batches of different sizes.

    With ``fsdp > 1`` each stage is sharded over the ``fsdp`` ranks of its
    replica by torch's ``fully_shard`` (HSDP with ``dp > 1``), gathered once
    per step and its gradients reduce-scattered once, or around each of its
    actions with ``FullySharded(gather="micro-batch")`` (see
    :mod:`stagewise.pipeline.parallel.fully_sharded`; DDP is not used then); each of
    the ``dp x fsdp`` ranks of a stage takes its own share of the batch. With
    ``tp > 1`` each layer is split over the ``tp`` ranks by
    ``options.tensor_parallel`` (see :mod:`stagewise.pipeline.parallel.tensor_parallel`),
    which take the same share. :meth:`parameters` then yields DTensors.

    Batch norms normalise each micro-batch with its own statistics, as with
    gradient accumulation; by default their running statistics move once per
    step, from the whole batch, not once per micro-batch (see
    ``PipelineOptions.batch_norm``).

    Args:
        model: a chain (see :func:`stagewise.partition.layers_of`), on the meta device or with real weights.
        partition: the split into stages; ``partition.n_stages`` must be ``n_ranks * n_virtual``.
        schedule: a built-in schedule's name, or a :class:`Schedule` (e.g. loaded from text).
        n_microbatches: micro-batches per step.
        loss_fn: ``loss_fn(output, target)`` for one micro-batch, a scalar tensor (reduced as
            ``options.loss.reduction`` says: with "tokens", the sum over the micro-batch's tokens).
        mesh: the process mesh, whose device every stage of this rank is on and whose timeout bounds every wait
            of this pipeline for another rank (transfers, tied weights, the replicas' all-reduce, clipping's
            all-reduce and the loss's sharing); by default :func:`stagewise.comm.init_mesh` with ``pp`` ranks
            and its default timeout, :data:`~stagewise.comm.timeouts.DEFAULT_TIMEOUT`.
        options: the rarer knobs, grouped (:class:`~stagewise.pipeline.PipelineOptions`: virtual stages, seed,
            the loss, precision and recomputation, diagnostics, weight-gradient fusion, data parallelism,
            sharding, batch norms' running statistics); None: their defaults.
    """

    def __init__(
        self,
        model: nn.Module,
        partition: Partition,
        *,
        schedule: ScheduleName | Schedule = "1f1b",
        n_microbatches: int,
        loss_fn: LossFn,
        mesh: PipelineMesh | None = None,
        options: PipelineOptions | None = None,
    ) -> None:
        options = options if options is not None else PipelineOptions()
        layers = layers_of(model)
        self._call: CallSpec | str = model.call if isinstance(model, CapturedChain) else type(model).__name__
        """How stage 0 takes a batch: a captured model's call spec, or a chain's name (see :func:`as_positional`);
        never the model, whose layers on other ranks this rank must not keep alive."""
        self.schedule = checked_schedule(layers, partition, schedule, n_microbatches, loss_fn=loss_fn, options=options)
        """The schedule this pipeline runs, validated (built from its name, or as given)."""
        self.partition = partition
        self.n_microbatches = n_microbatches
        self.loss_fn = loss_fn
        self.options = options
        """The rarer knobs this pipeline was built with: the one place each is read from (see :meth:`tracing`)."""
        self.mesh = mesh if mesh is not None else init_mesh(self.schedule.n_ranks, None)
        """The process mesh: this rank's place, its device, and the one timeout of every wait."""
        self._own_mesh = mesh is None
        try:
            self._runtime: Runtime = assemble(
                model, layers, partition, self.schedule, self.mesh, options, n_microbatches=n_microbatches
            )
            """The parts this rank runs (see :class:`~stagewise.pipeline.assembly.Runtime`)."""
        except BaseException:
            if self._own_mesh:
                quietly(self.mesh.close)
            raise
        self.stages = self._runtime.stages
        self._routing = RoutingLosses(
            routed_layers(self.stages.values()), self.mesh, present=bool(routed_layers([model]))
        )
        """This rank's mixture-of-experts layers' balance losses and loads (see :mod:`.loss.routing`)."""
        self.balance_loss: torch.Tensor | None = None
        """The last step's load-balancing loss of the model's mixture-of-experts layers (a mean over the global
        batch's sequences, summed over the layers), included in the loss :meth:`step` returned; None for a model
        without such layers, or before the first step."""
        self.model_names = self._runtime.model_names
        self.steps = 0
        """Calls of :meth:`step` so far."""
        self.skipped = False
        """Whether the last step was skipped for a non-finite loss."""
        self._bad_microbatch = -1
        self._last_result: StepResult | None = None
        """What the last pass over this rank's actions produced (its events, its losses), outputs dropped."""
        self._closed = False
        log.info(
            "rank %d holds stages %s (%d parameters) on %s; waits are bounded by %g s",
            self.mesh.rank,
            list(self.stages),
            sum(p.numel() for p in self.parameters()),
            self.mesh.device,
            self.mesh.timeout,
        )

    def close(self, *, wait: bool = True) -> None:
        """Destroy the process groups this pipeline made (its transport's, its tied copies', and its mesh's
        when it built the mesh; a mesh passed in stays, as does the default group), after waiting for its sends
        in flight (``wait=False`` drops them). The transport's threads and sockets go at once, those of a mesh
        the pipeline built when the pipeline object does. Every rank closes its pipeline; ``with Pipeline(...)
        as pipe:`` closes it on leaving. Closing again does nothing."""
        if self._closed:
            return
        self._closed = True
        try:
            self._runtime.close(wait=wait)
        finally:
            if self._own_mesh:
                self.mesh.close()

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` has run: the pipeline then steps and predicts no more."""
        return self._closed

    def __enter__(self) -> Pipeline:
        return self

    def __exit__(self, kind: type[BaseException] | None, *rest: object) -> None:
        if kind is None:
            self.close()
            return
        try:  # the block's error is the one to see: sends it left in flight are dropped, not waited for
            self.close(wait=False)
        except Exception as err:
            log.warning("closing the pipeline after an error failed too: %s", err)

    @contextmanager
    def tracing(self, path: str | Path | None) -> Iterator[None]:
        """Within the block, each step (and evaluation) writes its Chrome/Perfetto trace to ``path``, one file per
        rank (see :attr:`Diagnostics.chrome_trace`); None: none. After it, :attr:`options` are as they were."""
        before = self.options
        self.options = dataclasses.replace(
            before, diagnostics=dataclasses.replace(before.diagnostics, chrome_trace=path)
        )
        try:
            yield
        finally:
            self.options = before

    @property
    def is_first(self) -> bool:
        """True on the rank holding stage 0, which needs the inputs."""
        return 0 in self.stages

    @property
    def is_last(self) -> bool:
        """True on the rank holding the last stage, which needs the targets and computes the loss."""
        return self.schedule.n_stages - 1 in self.stages

    @property
    def compiled_graphs(self) -> int:
        """The graphs ``torch.compile`` compiled on this rank so far, recompilations included (0 when not compiled:
        see ``Compute.compile``). Equal shapes compile nothing after the first step."""
        compiled = self._runtime.compiled
        return 0 if compiled is None else compiled.count

    # --- running --------------------------------------------------------------------------------

    def _to_device(self, payload: Payload) -> Payload:
        if isinstance(payload, list):  # a list of tensors, as a data loader may give: taken as a tuple
            payload = tuple(payload)
        tensors, is_tuple = as_tensors(payload)  # refuses what is not a tensor or a tuple of them, naming it
        moved = tuple(t.to(self.mesh.device) for t in tensors)
        return moved if is_tuple else moved[0]

    def _split_inputs(self, inputs: Inputs | None) -> Microbatches | None:
        """The micro-batches of ``inputs`` on the rank of stage 0; None elsewhere."""
        self._check_open()
        if not self.is_first:
            return None
        return split(self._first_inputs(inputs), self.n_microbatches, what="inputs")

    def _first_inputs(self, inputs: Inputs | None) -> Payload:
        if inputs is None:
            raise ValueError(f"rank {self.mesh.rank} holds stage 0 and needs the inputs; got None")
        return self._to_device(as_positional(self._call, inputs))

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this Pipeline is closed (by close() or at the end of its with block); build a new one")

    def step(self, inputs: Inputs | None, targets: Payload | None = None) -> torch.Tensor:
        """One training step's forward and backward over the global batch; returns the loss on every rank.

        ``inputs`` are needed on the rank of stage 0 and ``targets`` on the
        rank of the last stage; other ranks may pass them or None. With
        ``dp > 1`` they are this replica's share of the global batch, and the
        loss returned is the global batch's.
        """
        m = self.n_microbatches
        ins = self._split_inputs(inputs)
        tgs = None
        if self.is_last:
            if targets is None:
                raise ValueError(
                    f"rank {self.mesh.rank} holds the last stage and needs the targets to compute the loss; got None"
                )
            tgs = self._split_targets(targets, m)
        if ins is not None and tgs is not None and ins.sizes != tgs.sizes:
            raise ValueError(f"inputs ({sum(ins.sizes)} samples) and targets ({sum(tgs.sizes)}) differ in batch size")
        run, nonfinite = self._runtime, self.options.loss.nonfinite
        if self._routing.present:
            first = self.mesh.layout.at(0, self.mesh.line)
            self._routing.begin(share_count(sum(ins.sizes) if ins else 0, sharing=run.sharing, first=first))
        # A skipped step drops its own gradients only, not those accumulated over earlier steps.
        earlier = EarlierGradients.copy(self.parameters()) if nonfinite == "skip" else None
        before = run.ties.set_aside()  # gradients accumulated over earlier steps: summed over the copies already
        if run.norms is not None:
            run.norms.begin()  # a step that failed before its end moved no statistics, and leaves none behind
        with torch.enable_grad(), self._gathered(reduce=True):
            result = run.executor.run(self.schedule.ranks[run.position], ins, tgs, self.loss_fn, training=True)
        if run.tensor_parallel:
            placed_like_parameters(self.parameters())
        if run.experts is not None:
            run.experts.synchronise()
        run.ties.sum_gradients(before)
        self._record(result)
        self.steps += 1
        bad = first_non_finite(result.microbatch_losses)
        loss = self._share_loss(result.loss, tgs, bad_microbatch=bad)
        if self._routing.present:
            self.balance_loss = self._routing.finish().to(loss.device)
            loss = loss + self.balance_loss
        where = self._bad_microbatch
        which = f"micro-batch {where} of replica {self.mesh.replica}" if where >= 0 else "in another replica"
        self.skipped = skipped_step(
            loss, nonfinite, where=f"at step {self.steps} (first non-finite: {which})", earlier=earlier,
            params=self.parameters(),
        )  # fmt: skip
        if run.norms is not None and not self.skipped:
            run.norms.commit()
        return loss

    def evaluate(self, inputs: Inputs | None, targets: Payload | None = None) -> torch.Tensor:
        """The loss on a batch, forward only and without gradients; returned on every rank, as by :meth:`step`.

        Replicas' batches may differ in size, and a batch smaller than ``n_microbatches`` (a last, partial
        one) runs as one micro-batch per sample.
        """
        if self.is_last and targets is None:
            raise ValueError(f"rank {self.mesh.rank} holds the last stage and needs the targets; got None")
        ins, count = self._forward_inputs(inputs)
        tgs = None
        if targets is not None and self.is_last:
            tgs = self._split_targets(targets, count)
        if ins is not None and tgs is not None and ins.sizes != tgs.sizes:
            raise ValueError(f"inputs ({sum(ins.sizes)} samples) and targets ({sum(tgs.sizes)}) differ in batch size")
        # Each micro-batch's loss is taken as its output arrives, weighted as step() weights them.
        loss = self._forward(ins, count, tgs).loss if tgs is not None else self._forward(ins, count).loss
        return self._share_loss(loss, tgs, training=False)  # no gradients: replicas may differ in size

    def _split_targets(self, targets: Payload, count: int) -> Microbatches:
        """The last stage's ``count`` micro-batches of ``targets``, each weighted as ``options.loss.reduction`` says;
        for a token mean, after counting the valid tokens of the global batch (over the replicas' last stages)."""
        whole, loss = self._to_device(targets), self.options.loss
        parts = split(whole, count, what="targets", reduction=loss.reduction)
        if loss.reduction != "tokens":
            return parts
        mine = valid_tokens(whole, loss.ignore_index, shift_labels=loss.shift_labels)
        return per_token(parts, global_tokens(mine, mesh=self.mesh, timeout=self.mesh.timeout))

    def _share_loss(
        self,
        loss: torch.Tensor | None,
        targets: Microbatches | None,
        *,
        bad_microbatch: int = -1,
        training: bool = True,
    ) -> torch.Tensor:
        """The global batch's loss on every rank (see :func:`share_loss`), from the last stage's ``loss`` on its
        ``targets`` (None elsewhere); keeps this replica's first bad micro-batch in :attr:`_bad_microbatch`. A
        token mean over no valid tokens is refused here, on every rank."""
        last = self.mesh.layout.at(self.schedule.rank_of(self.schedule.n_stages - 1), self.mesh.line)
        samples, tokens = (sum(targets.sizes), targets.tokens) if targets is not None else (0, -1)
        reduction = self.options.loss.reduction
        shared = share_loss(
            loss, samples, sharing=self._runtime.sharing, last=last, mean=reduction == "mean",
            bad_microbatch=bad_microbatch, tokens=tokens, training=training,
        )  # fmt: skip
        self._bad_microbatch = shared.bad_microbatch
        if reduction == "tokens":
            check_tokens(shared.tokens, self.options.loss.ignore_index)
        return shared.loss

    def clip_grad_norm_(
        self, max_norm: float, norm_type: float = 2.0, *, error_if_nonfinite: bool = False
    ) -> torch.Tensor:
        """Clip the gradients of the whole model by its total norm, as ``torch.nn.utils.clip_grad_norm_`` would.

        The norm is that of every gradient on every stage (each stage's
        replicas hold the same, already averaged, gradients; a tied
        parameter counts once; a shard, a tensor-parallel split or the experts
        one ``ep`` rank holds count once, over all ranks), all-reduced; every
        rank returns it and scales its own gradients by ``max_norm / norm``
        when the norm is larger.
        """
        mine = list(self.parameters())
        counted = [p for p in mine if self._runtime.ties.counted(p)]
        layout = self.mesh.layout
        sharded = layout.fsdp * layout.tp > 1 or self._runtime.sharded is not None or self._runtime.experts is not None
        # Sharded (or experts split over replicas): every rank holds a part of the norm, counted once however many
        # ranks hold that part.
        group = world_group() if sharded else self.mesh.pp_group
        copies = functools.partial(held_copies, ranks_per_stage=layout.lines) if sharded else None
        return clip_grad_norm_(
            mine, max_norm, norm_type, group=group, counting=Counting(counted, copies),
            error_if_nonfinite=error_if_nonfinite, device=self.mesh.device, timeout=self.mesh.timeout,
        )  # fmt: skip

    def predict(self, inputs: Inputs | None) -> Payload | None:
        """Forward only, without gradients; the model's output on the last stage's rank, None elsewhere.

        The micro-batches' outputs are joined along dim 0; an output with no batch dimension (a 0-dim
        auxiliary loss, say) comes back stacked, one value per micro-batch.
        """
        result = self._forward(*self._forward_inputs(inputs))
        return concat(result.outputs) if self.is_last else None

    def _forward_inputs(self, inputs: Inputs | None) -> tuple[Microbatches | None, int]:
        """A forward-only pass's micro-batches (on stage 0's rank) and their count: ``n_microbatches``, or the
        batch's size when smaller, as stage 0's rank tells the others."""
        self._check_open()
        count, payload = self.n_microbatches, None
        if self.is_first:
            payload = self._first_inputs(inputs)
            samples = batch_size(payload, "inputs")
            if samples == 0:
                raise ValueError("the inputs have no samples (a batch of 0); give at least one")
            count = min(count, samples)
        first = self.mesh.layout.at(0, self.mesh.line)
        count = share_count(count, sharing=self._runtime.sharing, first=first)
        return (None if payload is None else split(payload, count, what="inputs")), count

    def _forward(self, ins: Microbatches | None, count: int, targets: Microbatches | None = None) -> StepResult:
        """``count`` micro-batches' forwards, without gradients; on the last stage's rank, each one's outputs, or
        with ``targets`` their weighted loss."""
        forward = [Action(s, Kind.F, mb) for mb in range(count) for s in sorted(self.stages)]
        with torch.no_grad(), self._gathered(reduce=False):
            loss_fn = self.loss_fn if targets else None
            result = self._runtime.executor.run(forward, ins, targets, loss_fn, training=False)
        self._record(result)
        return result

    def _gathered(self, *, reduce: bool) -> AbstractContextManager[None]:
        """Sharded stages' whole parameters for the block (see :meth:`ShardedStages.gathering`); else nothing."""
        sharded = self._runtime.sharded
        return nullcontext() if sharded is None else sharded.gathering(reduce=reduce)

    def _record(self, result: StepResult) -> None:
        self._last_result = dataclasses.replace(result, outputs=[])  # the caller's: kept here, they would stay
        chosen = self.options.diagnostics.chrome_trace
        if chosen is not None:
            trace = Path(chosen)
            path = trace.with_name(f"{trace.stem}.rank{self.mesh.rank}{trace.suffix or '.json'}")
            path.parent.mkdir(parents=True, exist_ok=True)
            to_chrome_trace(result.events, path, spans=result.spans)
