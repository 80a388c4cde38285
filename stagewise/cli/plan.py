"""``stagewise plan``: a dry run that picks the layout and predicts step time and memory before booking GPUs."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import math
from pathlib import Path
from typing import Any

import torch
from torch import nn

from stagewise.cli import args
from stagewise.cli.commands import COMMANDS
from stagewise.comm.cpu_pinning import usable_cores
from stagewise.comm.payload import Payload
from stagewise.models import GPT, PRESETS
from stagewise.partition import layers_of
from stagewise.plan import Option, Plan, plan
from stagewise.plan.cluster import Cluster, Device, parse_devices
from stagewise.plan.planner import candidates, tensor_parallel_degrees
from stagewise.plan.synthesised import synthesised
from stagewise.plan.tensor_traffic import layer_traffic
from stagewise.plan.workload import DEFAULT_EXPERT_IMBALANCE, Workload, preset_model, workload, workload_under_load
from stagewise.run.planned_model import ModelRequest, planned_model
from stagewise.schedule import render
from stagewise.units import format_bytes, parse_bytes

log = logging.getLogger(__name__)


def _host_memory(text: str) -> float:
    """``--host-memory``: a size above 0, as ``parse_bytes`` reads it."""
    value = args.size(text)
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"expected a size above 0 such as 2TiB, got {text!r}")
    return value


def _host_bandwidth(text: str) -> float:
    """``--host-bandwidth``: bytes per second, a number above 0."""
    try:
        value = float(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"expected bytes per second such as 25e9, got {text!r}") from err
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"expected bytes per second above 0 such as 25e9, got {text!r}")
    return value


def _imbalance(text: str) -> float:
    """``--expert-imbalance``: a ratio >= 1."""
    try:
        value = float(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"expected a ratio >= 1 such as 1.25, got {text!r}") from err
    if not 1 <= value < math.inf:
        raise argparse.ArgumentTypeError(
            f"expected a ratio >= 1 such as 1.25 (the busiest rank's tokens over the mean), got {text!r}"
        )
    return value


def add(commands: Any) -> None:
    p = commands.add_parser(
        "plan",
        help=COMMANDS["plan"].help,
        description="Build the model on the meta device, cost every layer (FLOPs and bytes, or measured "
        "times with --profile), and search every layout: the exact partition under the devices' memory, the "
        "simulated step time and each rank's peak memory. Prints the best plans and why others were rejected.",
    )
    p.add_argument(
        "--model", default="gpt-small",
        help="a preset, hf:DIR (a local Hugging Face folder) or MODULE:FACTORY (a function returning a language model, "
        "as train takes it; with --input-shape, any nn.Module)",
    )  # fmt: skip
    p.add_argument(
        "--input-shape", default=None,
        help="for MODULE:FACTORY returning a model that takes no token ids: one sample's shape, e.g. 128 or 3x32x32",
    )  # fmt: skip
    p.add_argument("--input-dtype", default="float32", choices=["float32", "int64"], help="for MODULE:FACTORY")
    p.add_argument("--gpus", type=args.positive_int, default=None, help="devices in all (8)")
    p.add_argument("--gpu-memory", type=args.size, default=None, help="memory per device (80GiB)")
    p.add_argument("--gpu-flops", type=float, default=None, help="sustained FLOP/s per device, not the peak (400e12)")
    p.add_argument("--gpu-bandwidth", type=float, default=None, help="device memory bytes/s, optimizer step (2e12)")
    p.add_argument("--devices", default=None, help="mixed devices in rank order, e.g. 4x80GiB@400e12,4x40GiB@150e12")
    p.add_argument("--profile", action="store_true", help="measure layer times on --device instead of FLOPs")
    p.add_argument("--device", type=args.device, default=None, help="where --profile measures (default cpu)")
    p.add_argument(
        "--profile-ranks", type=args.positive_int, default=1,
        help="with --profile: processes measuring at once, as many as the job's ranks sharing this machine",
    )  # fmt: skip
    p.add_argument(
        "--batch-size", type=args.positive_int, default=64, help="samples per optimizer step (the global batch)"
    )
    p.add_argument("--seq-len", type=args.positive_int, default=None, help="tokens per sample (GPT; preset's)")
    p.add_argument("--micro-batch", type=args.positive_int, default=1, help="samples per profiled micro-batch")
    p.add_argument("--link-bandwidth", type=float, default=50e9, help="bytes/s between adjacent stages")
    p.add_argument("--link-latency", type=float, default=20e-6, help="seconds per point-to-point message")
    p.add_argument(
        "--network-bandwidth", type=float, default=25e9,
        help="bytes/s per device in collectives across nodes (all-reduce, FSDP's all-gather and reduce-scatter)",
    )  # fmt: skip
    p.add_argument(
        "--intra-node-bandwidth", type=float, default=300e9,
        help="bytes/s per device in collectives within a node (tensor parallelism; FSDP where its group fits)",
    )  # fmt: skip
    p.add_argument(
        "--gpus-per-node", type=args.positive_int, default=8, help="devices per node: tp never crosses a node"
    )
    p.add_argument(
        "--host-memory", type=_host_memory, default=None,
        help="host memory per node (e.g. 2TiB), shared by its GPUs, for offloaded optimizer state and activations; "
        "with --host-bandwidth, the search also tries offloading (default: not tried)",
    )  # fmt: skip
    p.add_argument(
        "--host-bandwidth", type=_host_bandwidth, default=None,
        help="bytes/s per device to and from host memory (e.g. 25e9, PCIe 4 x16); with --host-memory",
    )  # fmt: skip
    p.add_argument(
        "--host-cores", type=args.positive_int, default=None,
        help="CPU cores a CPU job's ranks share on one machine: with more ranks than cores they take turns, and a "
        "rank computing while others wait runs faster (default: this machine's with --profile on the cpu)",
    )  # fmt: skip
    p.add_argument(
        "--fsdp", type=args.positive_int, default=None, help="shard over this many ranks (default: searched)"
    )
    p.add_argument("--tp", type=args.positive_int, default=None, help="split layers over this many (default: searched)")
    p.add_argument(
        "--ep", type=args.positive_int, default=None,
        help="split each mixture-of-experts layer's experts over this many ranks, borrowed from fsdp (or dp with "
        "fsdp 1) (default: searched)",
    )  # fmt: skip
    p.add_argument(
        "--expert-imbalance", type=_imbalance, default=DEFAULT_EXPERT_IMBALANCE,
        help="routed tokens of the busiest expert-parallel rank over the mean (1.0: perfectly balanced); multiplies "
        f"its experts' compute, activations and all-to-all with ep > 1 (default {DEFAULT_EXPERT_IMBALANCE})",
    )  # fmt: skip
    p.add_argument("--optimizer", default="adamw", choices=["adamw", "sgd"], help="for the state per parameter")
    p.add_argument("--top", type=args.positive_int, default=8, help="plans to show")
    p.add_argument("--json", type=Path, default=None, help="write the best plan here (for `train --plan`)")
    p.add_argument("--picture", type=Path, default=None, help="draw the best plan's schedule here")
    p.add_argument(
        "--synthesise", action="store_true",
        help="also synthesise a schedule for the best layout's stages within its memory; --json then holds it "
        "where it is faster (one stage per rank, up to 16 ranks and 64 micro-batches)",
    )  # fmt: skip


def _cluster(ns: argparse.Namespace) -> Cluster:
    uniform = {"--gpus": ns.gpus, "--gpu-memory": ns.gpu_memory, "--gpu-flops": ns.gpu_flops}
    uniform["--gpu-bandwidth"] = ns.gpu_bandwidth
    if ns.devices is not None:
        given = [flag for flag, value in uniform.items() if value is not None]
        if given:
            raise ValueError(f"--devices lists every device; {', '.join(given)} describe uniform ones: leave them out")
        devices = parse_devices(ns.devices)
    else:
        memory = ns.gpu_memory if ns.gpu_memory is not None else parse_bytes("80GiB")
        flops = ns.gpu_flops if ns.gpu_flops is not None else 400e12
        bandwidth = ns.gpu_bandwidth if ns.gpu_bandwidth is not None else 2e12
        devices = (Device(memory, flops, bandwidth),) * (ns.gpus or 8)
    if (ns.host_memory is None) != (ns.host_bandwidth is None):
        flags = ("--host-memory", "--host-bandwidth") if ns.host_bandwidth is None else ("--host-bandwidth",
                                                                                          "--host-memory")  # fmt: skip
        raise ValueError(
            f"{flags[0]} is given without {flags[1]}; offloading to the host needs both, e.g. --host-memory 2TiB "
            "--host-bandwidth 25e9"
        )
    on_cpu = ns.profile and (ns.device or "cpu") == "cpu"
    return Cluster(
        devices, ns.link_bandwidth, ns.link_latency, ns.network_bandwidth, ns.gpus_per_node, ns.intra_node_bandwidth,
        host_memory=ns.host_memory, host_bandwidth=ns.host_bandwidth, host_cores=_host_cores(ns, len(devices)),
        side_stream=not on_cpu,
    )  # fmt: skip


def _host_cores(ns: argparse.Namespace, n_devices: int) -> int | None:
    """``--host-cores``, or this machine's cores where the costs are measured on its CPU for a job on one node."""
    if ns.host_cores is not None:
        return int(ns.host_cores)
    if ns.profile and (ns.device or "cpu") == "cpu" and n_devices <= ns.gpus_per_node:
        return usable_cores()
    return None


def _pinned(ns: argparse.Namespace, work: Workload, cluster: Cluster) -> list[Option] | None:
    """The candidate layouts with ``--fsdp``, ``--tp`` and ``--ep`` where given (None: every candidate)."""
    if ns.fsdp is None and ns.tp is None and ns.ep is None:
        return None
    if ns.ep is not None and ns.ep > 1 and not work.expert_counts:
        raise ValueError(f"--ep {ns.ep} splits mixture-of-experts layers, but {ns.model} has none; leave --ep out")
    degrees = tensor_parallel_degrees(work)
    if ns.tp is not None and ns.tp > 1 and ns.tp not in degrees:
        found = dict(work.tensor_parallel).get(ns.tp)
        raise ValueError(found if isinstance(found, str) else f"--tp {ns.tp}: {work.traffic(ns.tp)}")
    every = candidates(
        cluster.n_devices, len(work.costs), work.global_batch, tp_degrees=degrees, gpus_per_node=cluster.gpus_per_node,
        host=cluster.offloads, experts=work.expert_counts,
    )  # fmt: skip
    pins = {"fsdp": ns.fsdp, "tp": ns.tp, "ep": ns.ep}
    return [o for o in every if all(value is None or getattr(o, name) == value for name, value in pins.items())]


def _show(result: Plan, work: Workload, top: int) -> None:
    if result.options:
        listed = result.options[:top]
        width = max(36, *(len(o.describe()) for o in listed))
        hosted = any(o.rank_host_memory for o in listed)
        host_head = f" {'host per rank':>14}" if hosted else ""
        print(
            f"{'layout':<{width}} {'step':>10} {'bubble':>7} {'tokens/s':>12} {'peak memory per rank':>22}{host_head}"
        )
        for o in listed:
            tokens = o.samples_per_second * work.tokens_per_sample
            peak = format_bytes(max(o.rank_memory))
            host = f" {format_bytes(max(o.rank_host_memory)) if o.rank_host_memory else '-':>14}" if hosted else ""
            print(f"{o.describe():<{width}} {o.step_time:>9.4g}s {o.bubble:>7.1%} {tokens:>12.4g} {peak:>22}{host}")
        print(
            "options: +ckpt whole-layer checkpointing, +sel-ckpt selective, +gather/mb FSDP gathers per action, "
            "+offload-opt optimizer on the host, +offload-act activations to the host"
        )
    if result.rejected:
        print(f"rejected {len(result.rejected)} layouts, for example:")
        shown: set[str] = set()
        for o in result.rejected:
            key = (o.rejected or "").split(" needs ")[0].split(" not ")[0]
            if key not in shown and len(shown) < 5:
                shown.add(key)
                print(f"  {o.describe()}: {o.rejected}")
    if result.unranked:
        print(
            f"left out {len(result.unranked)} layouts that cannot be among the {top} fastest: a lower bound of their "
            "step time is slower, or no split of their stages fits the memory"
        )


def _workload(ns: argparse.Namespace, model: nn.Module, sample: Payload, tokens: int) -> Workload:
    """The model's costs under ``ns``: profiled here, or by as many processes as the job's ranks at once."""
    device = ns.device or "cpu"
    state = 4.0 if ns.optimizer == "adamw" else 3.0  # weights, gradients, and two moments or SGD's momentum
    if ns.profile and ns.profile_ranks > 1:
        if ns.model not in PRESETS:
            raise ValueError("--profile-ranks above 1 profiles presets only; profile MODULE:FACTORY with one rank")
        return workload_under_load(
            preset_model, (ns.model, ns.micro_batch, ns.seq_len), concurrent=ns.profile_ranks,
            global_batch=ns.batch_size, tokens_per_sample=tokens, state_multiplier=state, measure_on=device,
            optimizer=ns.optimizer,
        )  # fmt: skip
    loss = preset_model(ns.model, ns.micro_batch, ns.seq_len)[2] if ns.model in PRESETS else None
    return workload(
        model,
        sample,
        global_batch=ns.batch_size,
        tokens_per_sample=tokens,
        state_multiplier=state,
        measure_on=device if ns.profile else None,
        loss=loss,
        optimizer=ns.optimizer,
    )


def _active(work: Workload, params: int) -> str:
    """For a model with routed experts: its parameters active per token and its experts, else nothing."""
    routed = [c for c in work.experts if c is not None]
    if not routed:
        return ""
    active = params - sum(c.params * (1 - c.top_k / c.experts) for c in routed)
    return f" ({active:,.0f} active per token; {len(routed)} MoE layers of {work.expert_counts} routed experts)"


def _synthesised(best: Option, work: Workload, cluster: Cluster) -> str | None:
    """Print how a schedule synthesised for ``best``'s stages compares with its own; its text where faster."""
    found = synthesised(best, work, cluster)
    if isinstance(found, str):
        print(f"no schedule synthesised: {found}")
        return None
    own = best.simulation.step_time if best.simulation is not None else math.inf
    faster = found.step_time < own * (1 - 1e-9)
    print(
        f"synthesised for these stages: pipeline {found.step_time:.4g} s against {best.schedule}'s {own:.4g} s "
        f"({own / found.step_time:.3f}x), within its micro-batches in flight"
        + ("" if faster else f"; {best.schedule} stays")
    )
    return found.schedule.to_text() if faster else None


def _write_best(ns: argparse.Namespace, result: Plan, work: Workload, tokens: int, cluster: Cluster) -> None:
    """Print the best layout's partition and memory per rank (and a synthesised schedule's step, with
    ``--synthesise``); write its JSON and picture where asked."""
    best = result.best
    assert best is not None and best.partition is not None
    print(f"best: {best.describe()}, partition {list(best.partition.bounds)}")
    text = _synthesised(best, work, cluster) if ns.synthesise else None
    pairs = list(zip(best.rank_memory, best.rank_activation, strict=True))
    if len(pairs) > 8:
        top = max(range(len(pairs)), key=lambda r: pairs[r][0])
        print(f"fullest rank: {top}, {format_bytes(pairs[top][0])} ({format_bytes(pairs[top][1])} activations)")
    else:
        print("per rank: " + ", ".join(f"{format_bytes(m)} ({format_bytes(a)} activations)" for m, a in pairs))
    if best.rank_host_memory:
        print(f"host memory per rank: at most {format_bytes(max(best.rank_host_memory))} offloaded")
    if ns.json is not None:
        seq = tokens if tokens > 1 else None
        ns.json.write_text(
            result.to_json(work, model=ns.model, seq_len=seq, optimizer=ns.optimizer, schedule_text=text) + "\n"
        )
        print(f"wrote {ns.json}")
    if ns.picture is not None and best.simulation is not None:
        render(best.simulation.timeline, ns.picture, title=f"{ns.model}: {best.describe()}")
        print(f"wrote {ns.picture}")


def run(ns: argparse.Namespace) -> int:
    if not ns.profile and (ns.profile_ranks != 1 or ns.device is not None):
        flag = "--profile-ranks" if ns.profile_ranks != 1 else "--device"
        raise ValueError(f"{flag} says how --profile measures; add --profile, or leave {flag} out")
    request = ModelRequest(
        ns.model, micro_batch=ns.micro_batch, seq_len=ns.seq_len, input_shape=ns.input_shape,
        input_dtype=ns.input_dtype, profile_on=torch.device(ns.device or "cpu") if ns.profile else None,
    )  # fmt: skip
    planned = planned_model(request)
    model, sample, tokens = planned.model, planned.sample, planned.tokens_per_sample
    cluster = _cluster(ns)
    work = dataclasses.replace(_workload(ns, model, sample, tokens), expert_imbalance=ns.expert_imbalance)
    params = sum(p.numel() for p in model.parameters())
    devices = cluster.describe(speeds=not ns.profile)
    measured = f"; layer times measured on {ns.device or 'cpu'}" if ns.profile else ""
    print(f"{ns.model}: {len(work.costs)} layers, {params:,} parameters{_active(work, params)}; {devices}{measured}")
    if ns.tp is not None and ns.tp > 1 and isinstance(model, GPT) and ns.tp not in dict(work.tensor_parallel):
        # a degree the workload did not describe: what the GPT's plan makes of it (or why it cannot)
        from stagewise.models import gpt_parallel

        traffic = layer_traffic(layers_of(model), gpt_parallel.plan, ns.tp)
        work = dataclasses.replace(work, tensor_parallel=(*work.tensor_parallel, (ns.tp, traffic)))
    result = plan(work, cluster, options=_pinned(ns, work, cluster), top=ns.top)
    _show(result, work, ns.top)
    if result.best is None:
        least = result.smallest_memory
        need = f"; it would need at least {format_bytes(least)} per device" if least else ""
        print(f"no layout fits {cluster.n_devices} devices{need}")
        return 1
    _write_best(ns, result, work, tokens, cluster)
    return 0
