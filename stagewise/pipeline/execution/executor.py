"""The executor: runs one rank's actions of a schedule, forward, backward (or I then W) and the transfers between
stages, each pass over them a :class:`~.rank_pass.RankPass`."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from stagewise.comm import Transport
from stagewise.comm.payload import Payload
from stagewise.pipeline.config import LossFn, WeightGradientFusion
from stagewise.pipeline.execution.rank_pass import RankPass
from stagewise.pipeline.execution.receives import ACTIVATIONS, GRADIENTS, LOOKAHEAD
from stagewise.pipeline.loss.microbatch import Microbatches
from stagewise.pipeline.parallel.data_parallel import Replicas
from stagewise.pipeline.parallel.fully_sharded import ShardedStages
from stagewise.pipeline.stage.module import StageModule
from stagewise.schedule.actions import Action, Schedule
from stagewise.schedule.dependencies import Event
from stagewise.schedule.holdings import rank_pool
from stagewise.schedule.spans import Span


@dataclass
class StepResult:
    """What one rank's run of its actions produced."""

    loss: torch.Tensor | None
    """The sum of the weighted micro-batch losses, on the rank of the last stage."""
    outputs: list[Payload]
    """The last stage's output per micro-batch, when kept (forward-only runs without a loss: ``predict``)."""
    events: list[Event]
    """Each action as it really ran, in seconds from the start."""
    spans: list[Span]
    """Time spent waiting for transfers."""
    microbatch_losses: list[torch.Tensor] = field(default_factory=list)
    """On the rank of the last stage: each micro-batch's loss as ``loss_fn`` returned it, detached."""


class Executor:
    """Runs a rank's actions against its stages, posting receives early and sending without waiting.

    F runs the stage's layers and sends the output on. B runs autograd from
    the output gradient (or the weighted loss) into the parameters and the
    stage input, and sends the input gradient back. Zero-bubble splits B: I
    computes the input gradient and, on the way, the gradient of the output of
    every op that reads a parameter (:class:`stagewise.pipeline.backward.split.WeightUse`);
    W later turns each of those into that op's parameter gradients, so nothing
    is accumulated twice and no activation gradient is computed again. With
    fusion, I leaves each fused linear's output gradient and input in the
    micro-batch's own store, and W adds them to ``.grad`` with one GEMM per
    weight, without autograd. Receives for the next actions are posted before
    the current one computes, so transfers overlap compute. With ``fusion``, B
    accumulates linear weight gradients into ``.grad`` inside its GEMMs
    (:class:`stagewise.pipeline.backward.fusion.FusedWeightGradients`), except for the
    backward after which DDP all-reduces a stage, whose hooks must see it.
    Backwards may pool their fused weight gradients (:class:`WeightGradientStore`),
    computed as one GEMM per weight every ``pool`` backwards of the rank, or
    at the end of the step where every forward of a stage precedes its
    backwards (GPipe), or as many as keep the rank within the pipeline's peak
    in flight (:func:`stagewise.schedule.free_pool`; see :attr:`WeightGradientFusion.pool`).
    With stages sharded by FSDP (a :class:`ShardedStages` as ``replicas``) and
    gathered per micro-batch (``FullySharded(gather="micro-batch")``), each
    action's stage is gathered before it (after its input arrived), its
    gradients reduce-scattered after it, and the next action's stage's gather
    issued as soon as this stage is freed (see
    :class:`~stagewise.pipeline.parallel.fully_sharded.ActionGathers`).
    """

    def __init__(
        self,
        schedule: Schedule,
        position: int,
        stages: dict[int, StageModule],
        transport: Transport,
        peers: Sequence[int],
        *,
        replicas: Replicas | ShardedStages | None = None,
        grad_scale: float = 1.0,
        fusion: WeightGradientFusion | None = None,
    ) -> None:
        self.schedule = schedule
        self.position = position
        """This rank's place in the pipeline, 0 .. n_ranks - 1."""
        self.stages = stages
        self.transport = transport
        self.peers = list(peers)
        """Global rank of each pipeline position."""
        self.lookahead = LOOKAHEAD
        self.last = schedule.n_stages - 1
        self.replicas = replicas if isinstance(replicas, Replicas) else None
        """Data-parallel replicas of the stages, synchronised after each stage's last backward of a step."""
        self.sharded = replicas if isinstance(replicas, ShardedStages) else None
        """The stages sharded by FSDP (passed as ``replicas``); under ``gather="micro-batch"`` this gathers and frees
        them around each action."""
        self.grad_scale = grad_scale
        """Factor on the loss gradient (not the loss): ``dp`` for a summed loss, which DDP would otherwise average."""
        self.fusion = fusion
        """Run training forwards under :class:`FusedWeightGradients`; None: never."""
        self.last_events: list[Event] = []
        """The actions of the last run, as they ran."""
        self.exchanging: frozenset[int] = frozenset()
        """The stages whose layers exchange tokens by all-to-all, whose forwards and backwards run in pairs (see
        :mod:`.pairs`); empty: one action at a time."""

    @functools.cached_property
    def pool(self) -> int | None:
        """How many of this rank's backwards pool their weight gradients in training (:func:`rank_pool`)."""
        checkpointing = any(stage.checkpointing for stage in self.stages.values())
        return rank_pool(self.fusion, self.schedule, self.position, checkpointing=checkpointing)

    def send(self, payload: Payload, stage: int, mb: int, action: Action, stream: int) -> None:
        """Send ``payload`` (of micro-batch ``mb``, made by ``action``) to the rank of ``stage`` on ``stream``."""
        thing = "activation" if stream == ACTIVATIONS else "gradient"
        self.transport.send(
            payload,
            self.peers[self.schedule.rank_of(stage)],
            what=f"the {thing} of micro-batch {mb} from {action}",
            stream=stream,
            known=stream == GRADIENTS,  # the receiver knows: it sent the activation these gradients are for
        )

    def run(
        self,
        actions: Sequence[Action],
        inputs: Microbatches | None,
        targets: Microbatches | None,
        loss_fn: LossFn | None,
        *,
        training: bool = True,
    ) -> StepResult:
        """Run ``actions`` in order; ``training=False`` runs forwards only and keeps the last stage's outputs, or
        with ``loss_fn`` and ``targets`` only their weighted loss."""
        run = RankPass(self, actions, inputs, targets, loss_fn=loss_fn, training=training)
        i = 0
        while i < len(actions):
            if i in run.pairs:
                run.act_pair(i)
                i += 2
            else:
                run.act(i, actions[i])
                i += 1
        run.flush()
        self.transport.wait_sends()
        self.last_events = run.events
        return StepResult(run.total, run.outputs, run.events, run.receives.spans, run.losses)
