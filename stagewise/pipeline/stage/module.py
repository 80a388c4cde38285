"""A stage: the contiguous layers one rank owns, materialised on its device (see :mod:`.materialise`), and its run."""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils.checkpoint import checkpoint

from stagewise.comm.payload import as_tensors
from stagewise.errors import StagewiseError
from stagewise.partition import Layer
from stagewise.partition.layers import SharedParameter
from stagewise.partition.segment import Segment
from stagewise.pipeline.backward.fusion import FusedWeightGradients
from stagewise.pipeline.backward.plan import BackwardPlan
from stagewise.pipeline.backward.split import ParameterUses, WeightUse, stop_for_weight_gradients, unseen_reads
from stagewise.pipeline.config import Compute, SelectiveCheckpointing, WeightGradientFusion
from stagewise.pipeline.stage.batch_norm import StageNorms
from stagewise.pipeline.stage.compiled import CompiledGraphs, compile_layers
from stagewise.pipeline.stage.materialise import Materialising, materialise
from stagewise.pipeline.stage.offload import ActivationOffload
from stagewise.pipeline.stage.recompute import recompute_contexts
from stagewise.pipeline.stage.retie import retie

log = logging.getLogger(__name__)

_IN_PLACE_ON_LEAF = "leaf Variable that requires grad is being used in an in-place operation"
"""Autograd's error for an in-place change of a tensor whose gradient is wanted (or of a view of it)."""


_AUTOGRAD = BackwardPlan()
"""A forward that records nothing and fuses nothing: its backward is autograd's."""


_EAGER = Compute()
"""Every layer's forward as it is, nothing recomputed."""
_CPU = torch.device("cpu")


class StageError(StagewiseError, RuntimeError):
    """A stage's layers failed on what they were given; the message names the stage, its layers and the input."""


def _call(modes: Sequence[TorchFunctionMode], layer: nn.Module, x: object) -> object:
    """``layer(x)`` within ``modes``, the first outermost."""
    with ExitStack() as stack:
        for mode in modes:
            stack.enter_context(mode)
        return layer(x)


class StageModule(nn.Module):
    """The layers ``first .. first + len(layers) - 1`` of a chain, run one after another.

    Parameter ``p`` of layer ``blocks.3`` is named ``blocks.3.p`` here, as in the unsplit model.
    """

    def __init__(
        self,
        index: int,
        first: int,
        layers: Sequence[Layer],
        *,
        compute: Compute = _EAGER,
        device: torch.device = _CPU,
        fusion: WeightGradientFusion | None = None,
        compiled: CompiledGraphs | None = None,
    ) -> None:
        super().__init__()
        self.index = index
        """The stage's number in the pipeline."""
        self.first = first
        """Chain index of the stage's first layer."""
        self.names = [layer.name for layer in layers]
        self._qualify = [layer.qualify for layer in layers]
        self.layers = nn.ModuleList(layer.module for layer in layers)
        self.recomputes = [compute.checkpointing_of(name) for name in self.names]
        """What each layer recomputes in backward (``compute.activation_checkpointing`` for it): nothing (False),
        its whole forward (True), or the ops a :class:`SelectiveCheckpointing` does not keep."""
        self.checkpointing = any(self.recomputes)
        """Whether any of the stage's layers recomputes its forward in backward."""
        self.offload = ActivationOffload(device) if compute.offload_activations else None
        """Where the stage's saved activations go to host memory (``Compute.offload_activations``); None: they stay."""
        self.autocast = compute.autocast
        """Run the layers under ``torch.autocast`` with this dtype; None runs them as they are."""
        self.device_type = device.type
        self.fusion = fusion if fusion is not None else WeightGradientFusion()
        """Which weights a fused forward's backward accumulates itself (see :meth:`run`)."""
        self.capture: list[WeightUse] | None = None
        """While a list, every use of parameters is appended here as the layers run (see :class:`WeightUse`)."""
        self._large: dict[bool, list[nn.Parameter]] = {}
        """The parameters a fused forward may take, without and with pooling."""
        self._ids: frozenset[int] | None = None
        self.copies_input: bool | None = None
        """Whether the layers change their input in place, so that they run on a copy (None: not known yet)."""
        self._recorder: ParameterUses | None = None
        """Records the uses of parameters outside segments; built once: a stage's parameters are fixed once it runs."""
        self.compute_dtype: torch.dtype | None = None
        """Floating-point inputs are cast to this dtype before the layers run (FSDP's mixed precision, whose
        parameters are gathered in it); None: as they come."""
        self.batch_norms: StageNorms | None = None
        """While set, the stage's batch norms move no running statistics in its forwards: a training forward
        (one with gradients) collects what they normalised, for one update per step (see :class:`StageNorms`)."""
        self.compiled = compiled is not None
        """Whether each layer runs compiled (see :mod:`.compiled`): its backward is one graph, which a split
        backward cannot divide, so the executor gives it I and W at once, and it records no uses."""
        if compiled is not None:
            compile_layers(self.layers, compiled)
        for layer in self.layers:  # a segment's modules never run: its graph reports the ops that read them
            if isinstance(layer, Segment):
                layer.record = self._record_use
                layer.cut = stop_for_weight_gradients

    def _record_use(self, params: tuple[torch.Tensor, ...], output: object) -> None:
        if self.capture is None:
            return
        use = WeightUse.of(params, output)
        if use is not None:
            self.capture.append(use)

    def run(self, x: object, plan: BackwardPlan = _AUTOGRAD) -> object:
        """Apply the layers in order, setting up their backward as ``plan`` says.

        With ``plan.owners``, record every use of parameters (see :class:`WeightUse`);
        with ``plan.joint`` too, so that W may run one backward over all of them
        (see :attr:`ParameterUses.cut_all`).
        With ``plan.fused``, the backward of this forward accumulates the gradients
        of linear weights of at least :attr:`fusion`'s threshold (its pooled
        one, if ``plan.pooled``) straight into ``.grad``, or into ``plan.store``
        until its ``flush``; ``plan.anchor`` as in :class:`FusedWeightGradients`.

        A stage whose layers change their input in place (``ReLU(inplace=True)``
        right after the cut) runs on a copy of it: the input is a leaf whose
        gradient the pipeline sends back, which autograd lets nothing change in
        place. The first forward that needs an input gradient finds this out:
        if it fails so, its buffers (batch norms' statistics) are put back and it
        runs again on a copy, as does every forward after it.
        """
        apply = functools.partial(self._run_layers, plan=plan)
        items = x if isinstance(x, tuple) else (x,)
        if self.compute_dtype is not None:
            dtype = self.compute_dtype
            items = tuple(t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t for t in items)
            x = items if isinstance(x, tuple) else items[0]
        wanted = any(isinstance(t, torch.Tensor) and t.requires_grad for t in items)
        if self.copies_input is None and torch.is_grad_enabled() and wanted:
            kept = [(b, b.clone()) for b in self.buffers()]
            try:
                out = apply(x)
                self.copies_input = False
                return out
            except RuntimeError as err:
                if _IN_PLACE_ON_LEAF not in str(err):
                    raise
                with torch.no_grad():
                    for buffer, value in kept:
                        buffer.copy_(value)
                if plan.owners is not None:
                    plan.owners.clear()
                self.copies_input = True
                log.info("stage %d changes its input in place: it runs on a copy of it", self.index)
        if self.copies_input:
            copies = tuple(t.clone() if isinstance(t, torch.Tensor) and t.requires_grad else t for t in items)
            x = copies if isinstance(x, tuple) else copies[0]
        return apply(x)

    def _run_layers(self, x: object, *, plan: BackwardPlan) -> object:
        owners = plan.owners
        self.capture = owners
        cast = torch.autocast(self.device_type, dtype=self.autocast, enabled=self.autocast is not None)
        large = self._fusible(pooled=plan.pooled) if plan.fused else []
        fusing = (
            FusedWeightGradients(large, store=plan.store, anchor=plan.anchor, own=self._own_ids()) if large else None
        )
        modes: list[TorchFunctionMode] = [fusing] if fusing is not None else []
        norms = self.batch_norms
        if norms is not None:  # outermost; inside the checkpointed call, so a recomputation calls them the same way
            modes.insert(0, norms.mode())
        deferring: AbstractContextManager[None] = (
            norms.forward(collect=torch.is_grad_enabled()) if norms is not None else nullcontext()
        )
        recording = modes
        if owners is not None:
            if self._recorder is None:
                self._recorder = ParameterUses(self.parameters(), owners)
            self._recorder.uses = owners
            self._recorder.cut_all = plan.joint
            # Innermost, so that it sees each op as the model calls it: a segment reports its own ops instead.
            recording = [*modes, self._recorder]
        calls = {True: functools.partial(_call, modes), False: functools.partial(_call, recording)}
        offloading = (
            self.offload.saving(self.parameters())
            if self.offload is not None and torch.is_grad_enabled()
            else nullcontext()
        )
        try:
            with cast, deferring, offloading:
                for layer, recomputes in zip(self.layers, self.recomputes, strict=True):
                    call = calls[isinstance(layer, Segment)]
                    if recomputes and torch.is_grad_enabled():
                        # The recomputation must save what the forward saved: the modes go inside. It records no
                        # uses (a split backward's I and W each recompute; W starts from the forward's uses).
                        selective = recomputes if isinstance(recomputes, SelectiveCheckpointing) else None
                        recompute = functools.partial(recompute_contexts, layer, selective, self._recomputation)
                        x = checkpoint(call, layer, x, use_reentrant=False, context_fn=recompute)
                    else:
                        x = call(layer, x)
        finally:
            self.capture = None
        if owners is not None and self._recorder is not None and self._recorder.hidden:
            self._check_unseen(x)
        return x

    @contextmanager
    def _recomputation(self) -> Iterator[None]:
        """A checkpointed layer's forward run again in backward: the uses of parameters it makes go nowhere."""
        recorder = self._recorder
        if recorder is None:
            yield
            return
        uses, cut_all = recorder.uses, recorder.cut_all
        recorder.uses = []
        try:
            yield
        finally:
            recorder.uses, recorder.cut_all = uses, cut_all

    def _check_unseen(self, output: object) -> None:
        """Refuse parameters whose gradient W cannot reach: read by a custom Function (see :func:`unseen_reads`)."""
        assert self._recorder is not None
        hidden, self._recorder.hidden = self._recorder.hidden, {}
        unseen = unseen_reads(output, hidden)
        if not unseen:
            return
        names = {id(p): name for name, p in self.named_chain_parameters()}
        listed = ", ".join(f"{names.get(id(p), '?')} (in {fn})" for p, fn in unseen)
        if any(fn == "CheckpointFunctionBackward" for _, fn in unseen):
            where = "torch.utils.checkpoint with use_reentrant=True, which runs its forward with grad mode off"
            fix = "Pass use_reentrant=False"
        else:
            where = "a custom torch.autograd.Function, whose reads it cannot see, so that gradient would be lost"
            fix = (
                "Pass the parameter to the Function as a view (Fn.apply(x, self.w.view_as(self.w))), "
                "which W can start from"
            )
        raise RuntimeError(
            f"a split backward (I then W) computes each parameter's gradient from the ops that read it, but "
            f"{listed} {'is' if len(unseen) == 1 else 'are'} read inside {where}. {fix}, or use a schedule "
            "without a split backward (1f1b, gpipe)"
        )

    def _own_ids(self) -> frozenset[int]:
        """The ``id`` of every parameter of this stage, found once: a stage's parameters are fixed once it runs."""
        if self._ids is None:
            self._ids = frozenset(id(p) for p in self.parameters())
        return self._ids

    def _fusible(self, *, pooled: bool) -> list[nn.Parameter]:
        """The parameters a fused forward may take, listed once: a stage's parameters are fixed once it runs."""
        if pooled not in self._large:
            least = self.fusion.threshold(pooled=pooled)
            self._large[pooled] = [p for p in self.parameters() if p.numel() >= least]
        return self._large[pooled]

    def forward(self, x: object) -> object:
        return self.run(x)

    def named_chain_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """Parameters with the unsplit model's names."""
        for qualify, layer in zip(self._qualify, self.layers, strict=True):
            for pname, param in layer.named_parameters():
                yield qualify(pname), param

    def chain_state_dict(self) -> dict[str, torch.Tensor]:
        """Parameters and buffers with the unsplit model's names."""
        out: dict[str, torch.Tensor] = {}
        for qualify, layer in zip(self._qualify, self.layers, strict=True):
            for key, value in layer.state_dict().items():
                out[qualify(key)] = value
        return out


def failure(stage: StageModule, mb: int, data: object, err: BaseException) -> str:
    """The message of a :class:`StageError`: the stage, its layers, the micro-batch, its input and the cause."""
    tensors, _ = as_tensors(data)
    got = ", ".join(f"{tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}" for t in tensors)
    source = f"which stage {stage.index - 1} sent" if stage.index > 0 else "the inputs passed to step()"
    cause = str(err).strip().splitlines()[0]
    return (
        f"stage {stage.index} (layers {stage.names[0]} .. {stage.names[-1]}) failed in the forward of micro-batch "
        f"{mb} on its input [{got}], {source}: {type(err).__name__}: {cause}"
    )


def own_stages(
    layers: Sequence[Layer],
    bounds: Sequence[int],
    stages: Iterable[int],
    shared: Sequence[SharedParameter],
    *,
    making: Materialising,
    compute: Compute,
    fusion: WeightGradientFusion | None,
    compiled: CompiledGraphs | None = None,
) -> dict[int, StageModule]:
    """This rank's ``stages`` of ``layers`` split at ``bounds``, materialised as ``making`` says (see
    :func:`materialise`), run as ``compute`` says (compiled through ``compiled`` if given), and tied again where
    they share parameters (``shared``, found before materialising)."""
    out: dict[int, StageModule] = {}
    for s in stages:
        mine = layers[bounds[s] : bounds[s + 1]]
        for offset, layer in enumerate(mine):
            index = bounds[s] + offset
            materialise(layer.module, index, making.device, making.seed, init=making.init, shared=shared)
        out[s] = StageModule(
            s, bounds[s], mine, compute=compute, device=making.device, fusion=fusion, compiled=compiled
        )
    retie(layers, shared, {i for s in out for i in range(bounds[s], bounds[s + 1])})
    return out
