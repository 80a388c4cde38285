"""Why a layout cannot run: the one typed result of a refusal, and the checks and messages that give it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from stagewise.partition import MemoryModel, balance
from stagewise.plan.cluster import Cluster
from stagewise.plan.option import Option
from stagewise.plan.workload import Workload


@dataclass(frozen=True)
class Rejection:
    """Why a layout cannot run, returned where what was asked for (its setting, its partition) cannot be had."""

    reason: str
    """One line: what does not divide or fit, with its numbers."""
    rank_memory: tuple[float, ...] = ()
    """Where no split fits the memory: the bytes of the rank that overflows most in the leanest split (what a
    plan of which no layout fits reports the least of); empty otherwise."""


def shape_rejection(option: Option, workload: Workload, cluster: Cluster) -> Rejection | None:
    """Why ``option``'s shape cannot take ``workload``: more stages than layers, a batch that does not divide, a
    tensor-parallel group that would cross a node or that the model's plan cannot split, an expert-parallel
    degree that the layout or the experts cannot take."""
    n_stages = option.pp * option.n_virtual
    if len(workload.costs) < n_stages:
        return Rejection(f"{n_stages} stages for {len(workload.costs)} layers")
    shards = option.batch_shards
    if workload.global_batch % shards:
        what = f"dp={option.dp}" if option.fsdp == 1 else f"dp x fsdp = {shards}"
        return Rejection(f"global batch {workload.global_batch} not divisible by {what}")
    local = workload.global_batch // shards
    if local % option.n_microbatches:
        return Rejection(f"batch {local} per replica not divisible by m={option.n_microbatches}")
    why = expert_rejection(option, workload)
    if why is not None:
        return why
    if option.tp > 1:
        if cluster.gpus_per_node % option.tp:
            return Rejection(
                f"tp={option.tp} does not divide the {cluster.gpus_per_node} GPUs of a node: its group would cross one"
            )
        traffic = workload.traffic(option.tp)
        if isinstance(traffic, str):
            return Rejection(traffic)
    return None


def expert_rejection(option: Option, workload: Workload) -> Rejection | None:
    """Why ``option.ep`` cannot split ``workload``'s experts: the model has none, ep does not divide the dimension
    it borrows from (fsdp, or dp with fsdp = 1), or it does not divide the experts of a layer."""
    ep = option.ep
    if ep == 1:
        return None
    experts = workload.expert_counts
    if not experts:
        return Rejection(f"ep={ep}, but the model has no mixture-of-experts layers to split")
    borrowed = ("fsdp", option.fsdp) if option.fsdp > 1 else ("dp", option.dp)
    if borrowed[1] % ep:
        return Rejection(f"ep={ep} does not divide {borrowed[0]}={borrowed[1]}, whose ranks it borrows")
    if experts % ep:
        return Rejection(f"ep={ep} does not divide the {experts} experts of an MoE layer")
    return None


def shared_device(n_virtual: int) -> str:
    """Why a stage's memory is a fraction of its device's, where it is."""
    if n_virtual == 1:
        return ""
    return f"; each device holds {n_virtual} stages of the interleaved schedule, so a stage gets 1/{n_virtual} of it"


def recompute_rejection(recompute: float, smallest: float, n_virtual: int) -> Rejection | None:
    """Why recomputing one layer (``recompute`` bytes, under activation checkpointing) overflows the ``smallest``
    memory a stage has, if it does."""
    if recompute < smallest:
        return None
    return Rejection(
        f"recomputing one layer needs {recompute / 2**30:.1f} GiB >= {smallest / 2**30:.1f} GiB per stage"
        f"{shared_device(n_virtual)}"
    )


def transient_rejection(
    transient: Sequence[float], have: Sequence[float], recompute: float, loss: float, n_virtual: int
) -> Rejection | None:
    """Why computing one micro-batch (``transient`` bytes per stage) overflows a stage's ``have``, if it does."""
    last = len(transient) - 1
    for s, (need, own) in enumerate(zip(transient, have, strict=True)):
        if need >= own:
            what = "the loss" if s == last and need == recompute + loss else "one layer"
            where = "the last stage" if s == last else f"stage {s}"
            return Rejection(
                f"{what} on one micro-batch needs {need / 2**30:.1f} GiB >= {own / 2**30:.1f} GiB on {where}"
                f"{shared_device(n_virtual)}"
            )
    return None


def _gib(need: float, have: float) -> tuple[str, str]:
    """Both sizes in GiB, with one decimal, or as many more as it takes to tell them apart."""
    for digits in (1, 3, 6):
        pair = f"{need / 2**30:.{digits}f}", f"{have / 2**30:.{digits}f}"
        if pair[0] != pair[1]:
            break
    return pair


def memory_rejection(
    memory: MemoryModel, capacities: Sequence[float], transient: Sequence[float], n_virtual: int
) -> Rejection:
    """No split fits each stage's ``capacities`` (what its device has less the ``transient`` bytes of computing one
    micro-batch): the stage that overflows its own device most in the split that uses the least of each."""
    n_stages = len(capacities)
    lean = balance(memory, n_stages, speeds=capacities)
    worst = max(range(n_stages), key=lambda s: lean.loads[s] - capacities[s])  # the most over its device
    need, cap = _gib(lean.loads[worst] + transient[worst], capacities[worst] + transient[worst])
    reason = f"stage {worst} needs {need} GiB > {cap} GiB (in the leanest split){shared_device(n_virtual)}"
    # A rank of v such stages; it computes one micro-batch at a time, so holds the transient once.
    return Rejection(reason, rank_memory=(lean.loads[worst] * n_virtual + transient[worst],))
