"""Workload: what a model costs per layer for one micro-batch, profiled on meta, measured alone, or under load."""

from __future__ import annotations

import dataclasses
import math
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeAlias, cast

import torch
from torch import nn

from stagewise.comm import launch
from stagewise.comm.payload import Payload, as_tensors
from stagewise.comm.timeouts import DEFAULT_TIMEOUT, checked_timeout
from stagewise.errors import whole_number
from stagewise.models import GPT, preset
from stagewise.partition import LayerCost, layers_of, profile, shared_parameters
from stagewise.partition.call_spec import Inputs, positional_inputs
from stagewise.partition.layers import SharedParameter
from stagewise.pipeline import LossFn
from stagewise.plan.balanced_moe import balanced_routing
from stagewise.plan.expert_cost import ExpertCost, layer_expert_costs
from stagewise.plan.measure import OptimizerKind, measure_loss, measure_loss_bytes, measure_optimizer, meta_output
from stagewise.plan.tensor_traffic import LayerTraffic, layer_traffic

Built: TypeAlias = "tuple[nn.Module, Payload, tuple[LossFn, Payload] | None]"
"""What a model builder returns: the model on the meta device, one micro-batch of input, the loss and a target."""


_COUNTS = {
    "profiled_batch": "give the samples of the micro-batch the costs were profiled on",
    "global_batch": "give the samples of one optimizer step over all replicas (--batch-size)",
    "tokens_per_sample": "give the tokens of one sample (its sequence length), or 1",
}
"""The counts a :class:`Workload` holds, each a whole number >= 1, and how to mend one that is not."""


DEFAULT_EXPERT_IMBALANCE = 1.25
"""The default :attr:`Workload.expert_imbalance`: an assumption, not a measurement. Dropless routing balanced by
an auxiliary loss or a routing bias is balanced over a step on average, not in each micro-batch: the busiest rank
of an expert-parallel group sees some tens of percent more token choices than the mean, more with few experts per
rank and small micro-batches. 1.25 stands in the middle of that; give the ratio measured on the job's own routing
where it is known (``stagewise plan --expert-imbalance``)."""


@dataclass(frozen=True)
class Workload:
    """What is trained: the profiled layers (one micro-batch of ``profiled_batch`` samples) and the batch."""

    costs: tuple[LayerCost, ...]
    """Per layer: parameters, FLOPs, activation bytes, and time when measured."""
    profiled_batch: int
    """Samples in the micro-batch the costs were measured on."""
    global_batch: int
    """Samples per optimizer step over all replicas."""
    input_bytes: int
    """Bytes of one profiled micro-batch of the first layer's input."""
    tokens_per_sample: int = 1
    """For throughput: tokens in one sample (the sequence length of a language model)."""
    state_multiplier: float = 4.0
    """Copies of each parameter kept: 4 for fp32 Adam (weights, gradients, two moments), 2 for SGD."""
    optimizer_seconds_per_param: float | None = None
    """Measured optimizer-step time per parameter; None derives it from the device's memory bandwidth."""
    loss_seconds: tuple[float, float] = (0.0, 0.0)
    """Forward and backward seconds of the loss on one profiled micro-batch, when measured."""
    loss_bytes: int | None = None
    """Bytes the loss holds at its fullest on one profiled micro-batch, with the output it reads
    (:func:`~stagewise.plan.measure.measure_loss_bytes`); None: not known, and taken as one tensor the size of the
    output."""
    shared: tuple[SharedParameter, ...] = ()
    """Parameters several layers use (tied weights). A stage keeps one copy; copies on different ranks have
    their gradients summed every step."""
    tensor_parallel: tuple[tuple[int, tuple[LayerTraffic, ...] | str], ...] = ()
    """Per tensor-parallel degree: each layer's split and collectives under the model's plan, or why the plan
    cannot split the model that many ways. A degree not listed: the model has no plan."""
    profiled_processes: int = 1
    """Processes that computed at once on the machine while the costs were measured (:func:`workload_under_load`'s
    ``concurrent``): with :attr:`Cluster.host_cores`, the load the measured times were taken under."""
    experts: tuple[ExpertCost | None, ...] = ()
    """Per layer: what its mixture-of-experts layers' routed experts cost under balanced routing (None: it has
    none; included in :attr:`costs`, which the planner splits apart); empty: the model has no experts."""
    expert_imbalance: float = DEFAULT_EXPERT_IMBALANCE
    """The routed token choices of the busiest expert-parallel rank over the mean, in a micro-batch: multiplies
    its experts' compute, saved activations and all-to-all bytes where the experts are split (``ep > 1``). 1.0 is
    perfectly balanced routing; see :data:`DEFAULT_EXPERT_IMBALANCE`."""

    def traffic(self, tp: int) -> tuple[LayerTraffic, ...] | str:
        """Each layer's :class:`LayerTraffic` over ``tp`` ranks, or why there is none."""
        found = dict(self.tensor_parallel).get(tp)
        if found is None:
            return f"tp={tp}: the model has no tensor-parallel plan (GPT presets have one)"
        return found

    def __post_init__(self) -> None:
        whole_number("profiled_processes", self.profiled_processes, least=1, fix="give the processes measuring at once")
        for name, fix in _COUNTS.items():
            whole_number(name, getattr(self, name), least=1, fix=fix)
        if not 0 <= self.state_multiplier < math.inf:
            raise ValueError(f"state_multiplier must be >= 0 and finite, got {self.state_multiplier}")
        if not 1 <= self.expert_imbalance < math.inf:
            raise ValueError(
                f"expert_imbalance must be >= 1 and finite (the busiest rank's routed tokens over the mean; 1.0 is "
                f"perfectly balanced), got {self.expert_imbalance}"
            )
        if self.experts and len(self.experts) != len(self.costs):
            raise ValueError(
                f"experts describes {len(self.experts)} layers but costs {len(self.costs)}; give one entry per layer "
                "(None for a layer without experts), or none"
            )

    @property
    def expert_counts(self) -> int:
        """The routed experts of the MoE layer with the fewest (what ``ep`` must divide); 0 without experts."""
        return min((c.experts for c in self.experts if c is not None), default=0)


TP_DEGREES = (2, 4, 8)
"""The tensor-parallel degrees a workload describes: a node's GPUs, split in powers of two."""


def workload(
    model: nn.Module,
    sample: Inputs,
    *,
    global_batch: int,
    tokens_per_sample: int = 1,
    state_multiplier: float = 4.0,
    measure_on: torch.device | str | None = None,
    loss: tuple[LossFn, Payload] | None = None,
    optimizer: OptimizerKind = "adamw",
) -> Workload:
    """Profile ``model`` (on the meta device, or timed on ``measure_on``) for one micro-batch ``sample``: a
    tensor, a tuple of tensors, or a captured model's keyword inputs (``{"input_ids": ...}``), as
    :func:`~stagewise.partition.capture` and :func:`~stagewise.partition.auto` take them.

    Timing runs with one intra-op thread on the CPU, as each rank of
    ``stagewise train`` does, and also measures the optimizer step and, given
    ``loss=(loss_fn, target)`` for the micro-batch, the loss. For a model
    with a tensor-parallel plan (stagewise's GPT: :func:`stagewise.models.gpt_parallel.plan`),
    what each of :data:`TP_DEGREES` would split and communicate
    (:func:`~stagewise.plan.tensor_traffic.layer_traffic`). Mixture-of-experts layers are costed with balanced
    routing (:mod:`stagewise.plan.balanced_moe`): the ``top_k`` active experts' FLOPs, every expert's parameters,
    and what they cost apart in :attr:`Workload.experts` (with :data:`DEFAULT_EXPERT_IMBALANCE`; ``dataclasses.replace``
    sets another).
    """
    sample = positional_inputs(model, sample)  # keywords as a captured model takes them by position
    tensors, _ = as_tensors(sample)
    batch = int(tensors[0].shape[0])
    per_param = None
    loss_seconds = (0.0, 0.0)
    with balanced_routing(model) as routed:  # experts costed by their config, not by what meta tensors route
        output = None if loss is None else meta_output(model, sample)  # once, for both of the loss's measures
        if measure_on is not None:
            device = torch.device(measure_on)
            threads = torch.get_num_threads()
            if device.type == "cpu":
                torch.set_num_threads(1)
            try:
                costs = profile(model, sample, time=True, device=device)
                per_param = measure_optimizer(device, kind=optimizer)
                if loss is not None:
                    loss_seconds = measure_loss(model, sample, loss, device, output=output)
            finally:
                torch.set_num_threads(threads)
        else:
            costs = profile(model, sample)
        loss_bytes = None if loss is None else measure_loss_bytes(model, sample, loss, output=output)
        experts = layer_expert_costs(model, list(routed.values()))
    return Workload(
        costs=tuple(costs),
        shared=tuple(shared_parameters(layers_of(model))),
        profiled_batch=batch,
        global_batch=global_batch,
        input_bytes=sum(t.numel() * t.element_size() for t in tensors),
        tokens_per_sample=tokens_per_sample,
        state_multiplier=state_multiplier,
        optimizer_seconds_per_param=per_param,
        loss_seconds=loss_seconds,
        loss_bytes=loss_bytes,
        tensor_parallel=_gpt_traffic(model) if isinstance(model, GPT) else (),
        experts=experts,
    )


def _gpt_traffic(model: GPT) -> tuple[tuple[int, tuple[LayerTraffic, ...] | str], ...]:
    """Each tensor-parallel degree's traffic of stagewise's GPT (DTensor, which its plan needs, loaded here)."""
    from stagewise.models import gpt_parallel

    return tuple((tp, layer_traffic(layers_of(model), gpt_parallel.plan, tp)) for tp in TP_DEGREES)


def preset_model(name: str, micro_batch: int, seq_len: int | None) -> Built:
    """A preset on the meta device, one micro-batch of its input, and its loss with a target for that input."""
    config = preset(name)
    sample = config.example(micro_batch, seq_len)
    return config.build(device="meta"), sample, (cast(LossFn, config.loss), config.target(micro_batch, seq_len))


PASSES_ALLOWED = 8
"""Rank 0 profiles each layer 2 + 5 times (:func:`~stagewise.partition.profile`'s warm-up and repeats) and times
the optimizer and the loss: a rank waiting for it allows it this many of its own profiling passes (one run of each
layer), beyond the timeout."""


def _profile_rank(
    build: Callable[..., Built],
    args: tuple[Any, ...],
    options: Any,
    flag: str | None = None,
    timeout: float = DEFAULT_TIMEOUT,
) -> Workload | None:
    """Rank 0 profiles; the other ranks run the same layers meanwhile, to load the machine as training does, until
    rank 0 makes the file ``flag``: for ``timeout`` seconds, and :data:`PASSES_ALLOWED` passes of their own more."""
    model, sample, loss = build(*args)
    rank = int(os.environ.get("RANK", "0"))
    if flag is None or rank == 0:
        try:
            return workload(model, sample, loss=loss, **options)
        finally:
            if flag is not None:
                Path(flag).touch()
    seconds = checked_timeout(timeout)
    torch.set_num_threads(1)
    began = time.monotonic()
    longest = 0.0
    while not Path(flag).exists():
        waited = time.monotonic() - began
        if waited > seconds + PASSES_ALLOWED * longest:
            raise TimeoutError(
                f"rank {rank} waited {waited:.3g} s for rank 0 to finish profiling and make {flag}, longer than the "
                f"timeout of {seconds:g} s plus {PASSES_ALLOWED} of this rank's profiling passes ({longest:.3g} s "
                "each); rank 0 is stuck or gone"
            )
        start = time.monotonic()
        with balanced_routing(model):
            profile(model, sample, time=True, device=options["measure_on"], warmup=0, repeats=1)
        longest = max(longest, time.monotonic() - start)
    return None


def workload_under_load(
    build: Callable[..., Built],
    args: tuple[Any, ...],
    *,
    concurrent: int,
    global_batch: int,
    tokens_per_sample: int = 1,
    state_multiplier: float = 4.0,
    measure_on: str = "cpu",
    optimizer: OptimizerKind = "adamw",
) -> Workload:
    """Measure a workload in the first of ``concurrent`` local processes while the others run the same layers.

    The ranks of a job that share one machine's cores (or memory bandwidth)
    slow each other down, so a profile taken alone is too optimistic for
    them; this one is taken under the same load. ``build(*args)`` must be
    importable by the spawned processes and return the model (on the meta
    device), one micro-batch of its input, and the loss with its target (or None).
    """
    if concurrent < 1:
        raise ValueError(f"concurrent must be >= 1, got {concurrent}")
    options = {
        "global_batch": global_batch,
        "tokens_per_sample": tokens_per_sample,
        "state_multiplier": state_multiplier,
        "measure_on": measure_on,
        "optimizer": optimizer,
    }
    if concurrent == 1:
        alone = _profile_rank(build, args, options)
        assert alone is not None
        return alone
    with tempfile.TemporaryDirectory(prefix="stagewise-plan-") as folder:
        measured = launch(_profile_rank, concurrent, build, args, options, str(Path(folder) / "done"))[0]
    assert measured is not None
    return dataclasses.replace(measured, profiled_processes=concurrent)
