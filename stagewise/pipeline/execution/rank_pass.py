"""One pass over a rank's actions: F, B, I and W (one at a time, or a forward and a backward in a pair), what each
keeps for the next (its slot) and what it sends."""

from __future__ import annotations

import functools
import time
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Protocol

import torch

from stagewise.comm import Transport
from stagewise.comm.payload import Payload, PayloadLayout, as_tensors
from stagewise.pipeline.backward.fusion import WeightGradientStore
from stagewise.pipeline.backward.gradients import grad_tensors, gradient_layout, handed_over, pack_gradients
from stagewise.pipeline.backward.plan import BackwardPlan
from stagewise.pipeline.backward.split import WeightUse, weight_gradients
from stagewise.pipeline.config import LossFn, WeightGradientFusion
from stagewise.pipeline.execution.pairs import overlapped_pairs, run_together
from stagewise.pipeline.execution.receives import ACTIVATIONS, GRADIENTS, PostedReceives
from stagewise.pipeline.loss.microbatch import Microbatches, scalar_loss
from stagewise.pipeline.parallel.data_parallel import Replicas, sync_points
from stagewise.pipeline.parallel.fully_sharded import ShardedStages
from stagewise.pipeline.stage.module import StageError, StageModule, failure
from stagewise.schedule.actions import Action, Kind, Schedule
from stagewise.schedule.dependencies import Event


class Runner(Protocol):
    """What a pass reads of the :class:`~stagewise.pipeline.execution.executor.Executor` that runs it."""

    schedule: Schedule
    position: int
    stages: dict[int, StageModule]
    transport: Transport
    peers: list[int]
    lookahead: int
    last: int
    replicas: Replicas | None
    sharded: ShardedStages | None
    grad_scale: float
    fusion: WeightGradientFusion | None
    exchanging: frozenset[int]

    @property
    def pool(self) -> int | None: ...

    def send(self, payload: Payload, stage: int, mb: int, action: Action, stream: int) -> None: ...


@dataclass
class _Slot:
    """What one (stage, micro-batch) keeps from its forward until its backward is done."""

    inputs: Payload
    output: Payload
    owners: list[WeightUse]
    """When backward is split (zero-bubble): each use of parameters, for W."""
    loss: torch.Tensor | None = None
    received: list[Payload] = field(default_factory=list)
    """Payloads from the transport, handed back for reuse once the micro-batch is done."""
    owner_grads: list[list[torch.Tensor | None]] = field(default_factory=list)
    """Gradient of each owner's output, from I, for W."""
    store: WeightGradientStore | None = None
    """With a split backward and fusion: the fused weight gradients I leaves for this micro-batch's W."""
    anchor: torch.Tensor | None = None
    """An input of every fused op of the forward, whose gradient I asks for (see :class:`FusedWeightGradients`)."""
    joint: bool = False
    """W runs one backward over all the owners (the micro-batch DDP synchronises: its hooks fire once)."""


@dataclass(frozen=True)
class _ForwardWork:
    """A forward's input and how its backward will be taken, before its layers run."""

    data: Payload
    received: list[Payload]
    owners: list[WeightUse]
    plan: BackwardPlan
    store: WeightGradientStore | None
    anchor: torch.Tensor | None
    joint: bool


@dataclass(frozen=True)
class _BackwardWork:
    """Where a backward starts, before its autograd runs."""

    slot: _Slot
    roots: list[torch.Tensor]
    root_grads: list[torch.Tensor | None]
    wanted: list[torch.Tensor]
    per_owner: list[list[torch.Tensor]]


def _storages(payload: Payload) -> set[int]:
    """The addresses of the storages under a payload's tensors."""
    return {t.untyped_storage().data_ptr() for t in as_tensors(payload)[0]}


class RankPass:
    """The state of one pass over a rank's actions, and the actions themselves (see :class:`~.executor.Executor`)."""

    def __init__(
        self,
        executor: Runner,
        actions: Sequence[Action],
        inputs: Microbatches | None,
        targets: Microbatches | None,
        *,
        loss_fn: LossFn | None,
        training: bool,
    ) -> None:
        self.x = executor
        self.actions = actions
        self.inputs, self.targets, self.loss_fn, self.training = inputs, targets, loss_fn, training
        self.start = time.perf_counter()
        self.slots: dict[tuple[int, int], _Slot] = {}
        self.handoff: dict[tuple[int, int], Payload] = {}
        self.receives = PostedReceives(
            executor.schedule, executor.position, actions, executor.transport, executor.peers,
            gradient_layout_of=self._gradient_layout, start=self.start,
        )  # fmt: skip
        self.events: list[Event] = []
        self.outputs: list[Payload] = []
        self.total: torch.Tensor | None = None
        self.losses: list[torch.Tensor] = []
        self.sync = sync_points(actions) if training and executor.replicas is not None else set()
        """Indices of the actions whose backward all-reduces a stage's gradients over its replicas."""
        self.unfused = {(actions[i].stage, actions[i].microbatch) for i in self.sync}
        """Forwards whose backward DDP's hooks must see, so it accumulates through autograd."""
        self.split = {
            (a.stage, a.microbatch) for a in actions if a.kind is Kind.I and not executor.stages[a.stage].compiled
        }
        """Forwards whose backward is split into I and W (a schedule may split some and not others). Not a compiled
        stage's: its backward is one graph, so its I runs the whole backward and its W has nothing left to do."""
        fusion = executor.fusion if training else None
        self.pool = executor.pool if fusion is not None else 1
        """Flush the pooled weight gradients after every this many backwards; None: at the end of the step."""
        self.store = WeightGradientStore() if fusion is not None and self.pool != 1 else None
        """Fused weight gradients pooled until a flush."""
        self.backwards = 0
        self.held: list[Payload] = []
        """Received payloads that pooled weight gradients may still read: recycled after the flush."""
        sharded = executor.sharded
        self.gathers = None if sharded is None else sharded.around(actions, training=training)
        """Gathers and frees the sharded stages around each action (``gather="micro-batch"``); None: not here."""
        recomputing = {s for s, stage in executor.stages.items() if stage.checkpointing}
        together = training and bool(executor.exchanging) and self.gathers is None
        self.pairs = (
            overlapped_pairs(actions, exchanging=executor.exchanging, excluded=self.sync, recomputing=recomputing)
            if together
            else set()
        )
        """Indices of the forwards that run at once with the backward after them (see :mod:`.pairs`)."""

    def flush(self) -> None:
        """Compute the pooled weight gradients into ``.grad``, and recycle the buffers they read."""
        if self.store is not None:
            self.store.flush()
        for payload in self.held:
            self.x.transport.release(payload)
        self.held.clear()

    def _now(self) -> float:
        return time.perf_counter() - self.start

    def _gradient_layout(self, action: Action) -> PayloadLayout | None:
        slot = self.slots.get((action.stage, action.microbatch))
        return None if slot is None else gradient_layout(slot.output)

    def act(self, i: int, action: Action) -> None:
        self.receives.post(i + 1 + self.x.lookahead)
        incoming = self.receives.take(i)
        if self.gathers is not None:  # its gather, issued after the last action, overlapped the wait for its input
            self.gathers.before(i)
        began = self._now()
        sync = i in self.sync
        replicas = self.x.replicas
        # DDP's all-reduce runs in a synchronising backward: its failure between replicas is named.
        with replicas.synchronising(action.stage, action) if sync and replicas is not None else nullcontext():
            if action.kind is Kind.F:
                self._forward(action, incoming)
            elif action.kind.is_backward:
                self._backward(action, incoming, sync=sync)
            else:
                self._weights(action, sync=sync)
        ended = self._now()
        if self.gathers is not None:
            self.gathers.after(i)
        self.events.append(Event(self.x.position, action, began, ended))

    def act_pair(self, i: int) -> None:
        """Actions ``i`` (a forward) and ``i + 1`` (a whole backward of another stage) at once: their inputs taken
        here, the backward's autograd on a thread of its own beside the forward's layers, their outputs sent here."""
        forward, backward = self.actions[i], self.actions[i + 1]
        self.receives.post(i + 2 + self.x.lookahead)
        f_in, b_in = self.receives.take(i), self.receives.take(i + 1)
        began = self._now()
        f_work, b_work = self._forward_start(forward, f_in), self._backward_start(backward, b_in)
        ends: dict[str, float] = {}

        def forward_compute() -> object:
            out = self._forward_compute(forward, f_work)
            ends["F"] = self._now()
            return out

        def backward_compute() -> list[torch.Tensor]:
            grads = self._backward_compute(backward, b_work, sync=False)
            ends["B"] = self._now()
            return grads

        out, grads = run_together(forward_compute, backward_compute)
        self._forward_end(forward, f_work, out)
        self._backward_end(backward, grads)  # type: ignore[arg-type]
        self.events.append(Event(self.x.position, forward, began, ends["F"]))
        self.events.append(Event(self.x.position, backward, began, ends["B"]))

    def _forward(self, action: Action, incoming: Payload | None) -> None:
        work = self._forward_start(action, incoming)
        self._forward_end(action, work, self._forward_compute(action, work))

    def _forward_start(self, action: Action, incoming: Payload | None) -> _ForwardWork:
        """What F of ``action`` runs on: its input, and how its backward will be taken."""
        s, mb, x = action.stage, action.microbatch, self.x
        data, received = self._forward_input(s, mb, incoming)
        owners: list[WeightUse] = []
        split = self.training and (s, mb) in self.split
        fused = self.training and x.fusion is not None and (s, mb) not in self.unfused
        store, anchor = self.store, None
        if fused and split:  # this micro-batch's W computes what its I leaves in a store of its own
            store, anchor = WeightGradientStore(), torch.empty(0, device=x.transport.device, requires_grad=True)
        # One backward over all the uses where DDP synchronises (its hooks fire once), and where the stage
        # recomputes: each backward through a checkpointed layer recomputes it, so W runs one, not one per use.
        joint = split and ((s, mb) in self.unfused or x.stages[s].checkpointing)
        pooled = store is not None and store is self.store
        plan = BackwardPlan(
            owners if split else None, joint=joint, fused=fused, store=store, pooled=pooled, anchor=anchor
        )
        return _ForwardWork(data, received, owners, plan, store if split else None, anchor, joint)

    def _forward_compute(self, action: Action, work: _ForwardWork) -> object:
        """The stage's layers on the forward's input (no transfer: a pair may run it beside a backward)."""
        stage = self.x.stages[action.stage]
        try:
            return stage.run(work.data, work.plan)
        except (RuntimeError, TypeError, ValueError) as err:
            raise StageError(failure(stage, action.microbatch, work.data, err)) from err

    def _forward_end(self, action: Action, work: _ForwardWork, out: object) -> None:
        """Keep the forward's slot for its backward and take its output where it goes."""
        s, mb, x = action.stage, action.microbatch, self.x
        slot = _Slot(
            work.data, out, work.owners,  # type: ignore[arg-type]
            received=work.received, store=work.store, anchor=work.anchor, joint=work.joint,
        )  # fmt: skip
        scored = self._deliver(action, slot)
        if self.training:
            self.slots[(s, mb)] = slot
        else:  # a received buffer the output is a view of stays with the output (kept, or still being sent)
            kept = set() if scored else _storages(out)  # type: ignore[arg-type]
            for payload in work.received:
                if not _storages(payload) & kept:
                    x.transport.release(payload)

    def _forward_input(self, s: int, mb: int, incoming: Payload | None) -> tuple[Payload, list[Payload]]:
        """The input of stage ``s``'s forward of micro-batch ``mb``, and the received payloads it is."""
        if s == 0:
            if self.inputs is None:
                raise ValueError("the first stage needs inputs; pass them to step() on the rank that holds stage 0")
            return self.inputs.parts[mb], []
        if incoming is not None:
            return incoming, [incoming]
        return self.handoff.pop((s, mb)), []

    def _deliver(self, action: Action, slot: _Slot) -> bool:
        """Take the forward's output where it goes: the loss, the kept outputs, the next stage here or on another
        rank. Returns whether it was scored (its loss taken)."""
        s, mb, x, out = action.stage, action.microbatch, self.x, slot.output
        # A forward-only run with a loss (evaluation) takes each micro-batch's loss at once and keeps no output:
        # a language model's logits are its largest tensors, and one micro-batch's are held at a time.
        scored = s == x.last and (self.training or self.loss_fn is not None)
        if scored:
            self._loss(slot, mb)
        elif s == x.last:
            self.outputs.append(out)
        elif x.schedule.rank_of(s + 1) == x.position:
            self.handoff[(s + 1, mb)] = handed_over(out)
        else:
            x.send(out, s + 1, mb, action, ACTIVATIONS)
        return scored

    def _loss(self, slot: _Slot, mb: int) -> None:
        if self.targets is None or self.loss_fn is None:
            raise ValueError("the last stage needs targets and a loss_fn; pass targets to step() on its rank")
        loss = scalar_loss(self.loss_fn, slot.output, self.targets.parts[mb])
        self.losses.append(loss.detach().clone())  # a loss that views the output may view a received buffer
        slot.loss = loss * self.targets.weights[mb]
        value = slot.loss.detach()
        self.total = value if self.total is None else self.total + value

    def _arm(self, stage: int, outputs: list[torch.Tensor]) -> list[torch.Tensor]:
        """Make the coming backward from ``outputs`` all-reduce ``stage``'s gradients over the replicas; returns
        the roots to add to it (see :meth:`Replicas.prepare`)."""
        assert self.x.replicas is not None
        return self.x.replicas.prepare(stage, outputs)

    def _backward(self, action: Action, incoming: Payload | None, *, sync: bool = False) -> None:
        work = self._backward_start(action, incoming)
        self._backward_end(action, self._backward_compute(action, work, sync=sync))

    def _backward_start(self, action: Action, incoming: Payload | None) -> _BackwardWork:
        """Where B or I of ``action`` starts: its slot, its roots and their gradients, what it is asked for."""
        s, mb = action.stage, action.microbatch
        slot = self.slots[(s, mb)]
        roots, root_grads = self._roots(s, mb, slot, incoming)
        wanted = grad_tensors(slot.inputs) if s > 0 else []
        if slot.anchor is not None:  # fused ops leave their weight gradients in the slot's store: W needs no autograd
            slot.owners = [use for use in slot.owners if not use.fused]
        per_owner = [grad_tensors(use.output) for use in slot.owners]
        return _BackwardWork(slot, roots, root_grads, wanted, per_owner)

    def _backward_compute(self, action: Action, work: _BackwardWork, *, sync: bool) -> list[torch.Tensor]:
        """The backward's autograd; returns the stage input's gradients (no transfer)."""
        s, mb = action.stage, action.microbatch
        slot, roots, root_grads, wanted, per_owner = work.slot, work.roots, work.root_grads, work.wanted, work.per_owner
        if not roots:  # nothing here depends on a gradient-carrying input or parameter
            slot.owner_grads = [[None] * len(group) for group in per_owner]
            if sync and action.kind is Kind.B:  # the replicas still all-reduce what earlier micro-batches left
                self.flush()
                extra = self._arm(s, [])
                if extra:
                    torch.autograd.backward(extra)
            return [torch.zeros_like(t) for t in wanted]
        if (s, mb) not in self.split or not (wanted or per_owner):
            return self._whole_backward(s, roots, root_grads, wanted, sync=sync)
        return self._input_backward(slot, roots, root_grads, wanted, per_owner)

    def _backward_end(self, action: Action, input_grads: list[torch.Tensor]) -> None:
        """Send the input's gradients back and, after B, let its slot go."""
        s, mb = action.stage, action.microbatch
        if s > 0:
            self._answer(action, input_grads)
        if action.kind is Kind.B:
            self._done(self.slots.pop((s, mb)))
            self.backwards += 1
            if self.pool is not None and self.backwards % self.pool == 0:
                self.flush()

    def _roots(
        self, s: int, mb: int, slot: _Slot, incoming: Payload | None
    ) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
        """Where stage ``s``'s backward of ``mb`` starts, and the gradients it starts with: the weighted loss on
        the last stage (scaled by ``grad_scale``), else the output and the gradient the next stage sent."""
        x = self.x
        if s == x.last:
            assert slot.loss is not None
            roots = [slot.loss] if slot.loss.requires_grad else []  # no gradient: nothing trainable feeds it
            scale = x.grad_scale
            return roots, [None if scale == 1 else torch.full_like(r, scale) for r in roots]
        grads = incoming if incoming is not None else self.handoff.pop((s, mb))
        if incoming is not None:
            slot.received.append(incoming)
        roots = grad_tensors(slot.output)
        return roots, list(as_tensors(grads)[0]) if roots else []

    def _whole_backward(
        self,
        s: int,
        roots: list[torch.Tensor],
        root_grads: list[torch.Tensor | None],
        wanted: list[torch.Tensor],
        *,
        sync: bool,
    ) -> list[torch.Tensor]:
        """B: one autograd backward into the parameters and the stage's inputs; returns the inputs' gradients."""
        if sync:
            self.flush()  # DDP all-reduces .grad during this backward: it must be complete
            extra = self._arm(s, roots)
            roots, root_grads = [*roots, *extra], [*root_grads, *(None for _ in extra)]
        torch.autograd.backward(roots, root_grads)
        return [t.grad if t.grad is not None else torch.zeros_like(t) for t in wanted]

    def _input_backward(
        self,
        slot: _Slot,
        roots: list[torch.Tensor],
        root_grads: list[torch.Tensor | None],
        wanted: list[torch.Tensor],
        per_owner: list[list[torch.Tensor]],
    ) -> list[torch.Tensor]:
        """I: the inputs' gradients and, for W, those of each parameter-reading op's output (kept in the slot)."""
        flat = [t for group in per_owner for t in group]
        anchor = [slot.anchor] if slot.anchor is not None else []
        # The graph stays for W only where W runs autograd through it.
        got = torch.autograd.grad(
            roots, [*wanted, *flat, *anchor], root_grads, retain_graph=bool(flat), allow_unused=True
        )
        rest: list[torch.Tensor | None] = list(got[len(wanted) : len(wanted) + len(flat)])
        for group in per_owner:
            slot.owner_grads.append(rest[: len(group)])
            rest = rest[len(group) :]
        return [g if g is not None else torch.zeros_like(t) for g, t in zip(got, wanted, strict=False)]

    def _answer(self, action: Action, input_grads: list[torch.Tensor]) -> None:
        """Send the stage's input gradients to the previous stage (here or on its rank). Always, so the previous
        stage never waits in vain; an empty tensor means "no gradient" (it has no bytes: nothing travels, and the
        receiver expects exactly that)."""
        s, mb, x = action.stage, action.microbatch, self.x
        answer = pack_gradients(input_grads) if input_grads else torch.zeros(0, device=x.transport.device)
        if x.schedule.rank_of(s - 1) == x.position:
            self.handoff[(s - 1, mb)] = answer
        else:
            x.send(answer, s - 1, mb, action, GRADIENTS)

    def _weights(self, action: Action, *, sync: bool = False) -> None:
        slot = self.slots.pop((action.stage, action.microbatch))
        arm = functools.partial(self._arm, action.stage) if sync else None  # W's backwards complete the gradients
        weight_gradients(slot.owners, slot.owner_grads, joint=slot.joint, before=arm)
        if slot.store is not None:  # after autograd, which may pass a fused op again: it leaves nothing twice
            slot.store.flush()
        self._done(slot)

    def _done(self, slot: _Slot) -> None:
        if self.store:  # weight gradients waiting in the pool may read received tensors until the flush
            self.held.extend(slot.received)
            return
        for payload in slot.received:
            self.x.transport.release(payload)
