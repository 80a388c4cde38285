"""``stagewise plan``: a dry run that picks the layout and predicts step time and memory before booking GPUs."""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import logging
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from stagewise.cli import args
from stagewise.comm import Payload
from stagewise.models import GPT, PRESETS, GPTConfig, gpt_parallel
from stagewise.partition import Layer, layers_of
from stagewise.partition.profile import working_copy
from stagewise.plan import Option, Plan, plan
from stagewise.plan.cluster import Cluster, Device, parse_devices
from stagewise.plan.planner import candidates, tensor_parallel_degrees
from stagewise.plan.synthesised import synthesised
from stagewise.plan.tensor_traffic import layer_traffic
from stagewise.plan.workload import Workload, preset_model, workload, workload_under_load
from stagewise.run.user_model import HF, UserModel, model_of
from stagewise.schedule import render
from stagewise.units import format_bytes, parse_bytes

log = logging.getLogger(__name__)


def add(commands: Any) -> None:
    p = commands.add_parser(
        "plan",
        help="choose pp x dp, micro-batches, schedule and checkpointing; predict step time and memory",
        description="Build the model on the meta device, cost every layer (FLOPs and bytes, or measured "
        "times with --profile), and search every layout: the exact partition under the devices' memory, the "
        "simulated step time and each rank's peak memory. Prints the best plans and why others were rejected.",
    )
    p.add_argument(
        "--model", default="gpt-small",
        help="a preset, hf:DIR (a local Hugging Face folder) or MODULE:FACTORY returning an nn.Module",
    )  # fmt: skip
    p.add_argument("--input-shape", default=None, help="for MODULE:FACTORY: one sample's shape, e.g. 128 or 3x32x32")
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
    p.add_argument("--global-batch", type=args.positive_int, default=64, help="samples per optimizer step")
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
        "--fsdp", type=args.positive_int, default=None, help="shard over this many ranks (default: searched)"
    )
    p.add_argument("--tp", type=args.positive_int, default=None, help="split layers over this many (default: searched)")
    p.add_argument("--optimizer", default="adamw", choices=["adamw", "sgd"], help="for the state per parameter")
    p.add_argument("--top", type=args.positive_int, default=8, help="plans to show")
    p.add_argument("--json", type=Path, default=None, help="write the best plan here (for `train --plan`)")
    p.add_argument("--picture", type=Path, default=None, help="draw the best plan's schedule here")
    p.add_argument(
        "--synthesise", action="store_true",
        help="also synthesise a schedule for the best layout's stages within its memory; --json then holds it "
        "where it is faster (one stage per rank, up to 16 ranks and 64 micro-batches)",
    )  # fmt: skip


def _model(ns: argparse.Namespace) -> tuple[nn.Module, Payload, int]:
    """The model on the meta device, one profiled micro-batch, and tokens per sample."""
    if ns.model in PRESETS:
        config = PRESETS[ns.model]
        if ns.input_shape is not None:
            raise ValueError(f"--input-shape applies to MODULE:FACTORY models; {ns.model} knows its input")
        args.check_seq_len(ns.seq_len, ns.model)
        sample = config.example(ns.micro_batch, ns.seq_len)
        tokens = int(sample.shape[1]) if isinstance(config, GPTConfig) else 1
        return config.build(device="meta"), sample, tokens
    if ns.model.startswith(HF):
        if ns.input_shape is not None:
            raise ValueError(f"--input-shape applies to MODULE:FACTORY models; {ns.model} takes token ids")
        user = model_of(ns.model)
        assert isinstance(user, UserModel)
        seq_len = ns.seq_len or 128
        chain = user.chain(ns.micro_batch, seq_len)
        return chain, chain.call.positional(user.example(ns.micro_batch, seq_len)), seq_len
    module_name, _, factory_name = ns.model.partition(":")
    if not factory_name:
        raise ValueError(f"--model {ns.model!r} is neither a preset ({sorted(PRESETS)}) nor MODULE:FACTORY")
    factory = getattr(importlib.import_module(module_name), factory_name, None)
    if not callable(factory):
        raise ValueError(f"{module_name} has no callable {factory_name!r}")
    if ns.input_shape is None:
        raise ValueError("--model MODULE:FACTORY needs --input-shape, one sample's shape such as 128 or 3x32x32")
    try:
        dims = [int(x) for x in str(ns.input_shape).split("x")]
    except ValueError:
        dims = []
    if not dims or min(dims) < 1:
        raise ValueError(
            f"--input-shape {ns.input_shape} is not one sample's shape: give sizes >= 1 such as 128 or 3x32x32"
        )
    shape = [ns.micro_batch, *dims]
    with torch.device("meta"):
        model = factory()
    if not isinstance(model, nn.Module):
        raise TypeError(f"{ns.model} returned a {type(model).__name__}, not an nn.Module")
    dtype = torch.int64 if ns.input_dtype == "int64" else torch.float32
    sample = torch.zeros(shape, dtype=dtype)
    _check_input(ns, model, sample)
    return model, sample, shape[1] if dtype == torch.int64 and len(shape) == 2 else 1


_FAILURES = (RuntimeError, ValueError, TypeError, IndexError)
"""What a forward raises on an input it cannot take (NotImplementedError, a meta op missing, is a RuntimeError)."""


def _reason(err: BaseException) -> str:
    return str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__


def _check_input(ns: argparse.Namespace, model: nn.Module, sample: torch.Tensor) -> None:
    """Refuse a micro-batch ``sample`` that the factory's ``model`` (on meta) cannot take, with the reason.

    The meta device computes shapes only, so a forward that reads its data (``.item()``, ``if tensor``,
    ``torch.nonzero``, boolean masks) fails there whatever the shape, with a RuntimeError like a wrong shape's:
    only their messages differ. A meta failure is therefore decided on a real device. With --profile, the
    model's layers run there one at a time, as profiling runs them. Without it the plan profiles on meta, which
    this model cannot pass anyway; only the layer that failed runs on the CPU, to say which of the two it was.
    """
    taken = f"a micro-batch of shape {list(sample.shape)} ({ns.input_dtype})"
    try:  # on the meta device: shapes only, nothing computed
        with torch.no_grad():
            model(sample.to("meta"))
        return
    except _FAILURES as err:
        log.debug("%s on the meta device with %s: %s", ns.model, taken, _reason(err))
    layers = layers_of(model)
    if ns.profile:
        _run_on(ns, layers, sample, torch.device(ns.device or "cpu"), taken)
        return
    current: Payload = sample.to("meta")
    for index, layer in enumerate(layers):
        try:
            with torch.no_grad():
                current = layer.module(current)
        except _FAILURES as err:
            _run_on(ns, layers[index : index + 1], current, torch.device("cpu"), taken)
            raise ValueError(
                f"{ns.model} takes {taken} on the CPU, but its layer {layer.name!r} cannot run on the meta device: "
                f"{_reason(err)}; its forward reads the data, which the meta device has not: add --profile to plan "
                "the model on a real device (--device)"
            ) from err
    # The model's forward failed on meta but its chain of layers, which the plan profiles, did not.


def _run_on(ns: argparse.Namespace, layers: Sequence[Layer], inputs: Payload, device: torch.device, taken: str) -> None:
    """Run ``layers`` one after another on ``device``, each a fresh copy as profiling makes it, from zeros shaped
    like ``inputs``; refuse the input shape with the reason when one fails."""
    current = _zeros(inputs, device)
    for layer in layers:
        work = working_copy(layer.module, device)
        try:
            with torch.no_grad():
                current = work(current)
        except _FAILURES as err:
            raise ValueError(
                f"{ns.model} cannot take {taken}: {_reason(err)} (layer {layer.name!r} on {device}); give "
                "--input-shape as the shape of one sample the model takes"
            ) from err
        del work


def _zeros(payload: Payload, device: torch.device) -> Payload:
    """Zeros shaped like ``payload`` on ``device``: what a meta tensor stands for in profiling."""
    if isinstance(payload, torch.Tensor):
        return torch.zeros_like(payload, device=device)
    return tuple(torch.zeros_like(t, device=device) for t in payload)


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
    return Cluster(
        devices, ns.link_bandwidth, ns.link_latency, ns.network_bandwidth, ns.gpus_per_node, ns.intra_node_bandwidth
    )


def _pinned(ns: argparse.Namespace, work: Workload, cluster: Cluster) -> list[Option] | None:
    """The candidate layouts with ``--fsdp`` and ``--tp`` where given (None: every candidate)."""
    if ns.fsdp is None and ns.tp is None:
        return None
    degrees = tensor_parallel_degrees(work)
    if ns.tp is not None and ns.tp > 1 and ns.tp not in degrees:
        found = dict(work.tensor_parallel).get(ns.tp)
        raise ValueError(found if isinstance(found, str) else f"--tp {ns.tp}: {work.traffic(ns.tp)}")
    every = candidates(
        cluster.n_devices, len(work.costs), work.global_batch, tp_degrees=degrees, gpus_per_node=cluster.gpus_per_node
    )
    return [o for o in every if (ns.fsdp is None or o.fsdp == ns.fsdp) and (ns.tp is None or o.tp == ns.tp)]


def _show(result: Plan, work: Workload, top: int) -> None:
    if result.options:
        listed = result.options[:top]
        width = max(36, *(len(o.describe()) for o in listed))
        print(f"{'layout':<{width}} {'step':>10} {'bubble':>7} {'tokens/s':>12} {'peak memory per rank':>22}")
        for o in listed:
            tokens = o.samples_per_second * work.tokens_per_sample
            peak = format_bytes(max(o.rank_memory))
            print(f"{o.describe():<{width}} {o.step_time:>9.4g}s {o.bubble:>7.1%} {tokens:>12.4g} {peak:>22}")
    if result.rejected:
        print(f"rejected {len(result.rejected)} layouts, for example:")
        shown: set[str] = set()
        for o in result.rejected:
            key = (o.rejected or "").split(" needs ")[0].split(" not ")[0]
            if key not in shown and len(shown) < 5:
                shown.add(key)
                print(f"  {o.describe()}: {o.rejected}")


def _workload(ns: argparse.Namespace, model: nn.Module, sample: Payload, tokens: int) -> Workload:
    """The model's costs under ``ns``: profiled here, or by as many processes as the job's ranks at once."""
    device = ns.device or "cpu"
    state = 4.0 if ns.optimizer == "adamw" else 3.0  # weights, gradients, and two moments or SGD's momentum
    if ns.profile and ns.profile_ranks > 1:
        if ns.model not in PRESETS:
            raise ValueError("--profile-ranks above 1 profiles presets only; profile MODULE:FACTORY with one rank")
        return workload_under_load(
            preset_model, (ns.model, ns.micro_batch, ns.seq_len), concurrent=ns.profile_ranks,
            global_batch=ns.global_batch, tokens_per_sample=tokens, state_multiplier=state, measure_on=device,
            optimizer=ns.optimizer,
        )  # fmt: skip
    loss = preset_model(ns.model, ns.micro_batch, ns.seq_len)[2] if ns.model in PRESETS else None
    return workload(
        model,
        sample,
        global_batch=ns.global_batch,
        tokens_per_sample=tokens,
        state_multiplier=state,
        measure_on=device if ns.profile else None,
        loss=loss,
        optimizer=ns.optimizer,
    )


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
    model, sample, tokens = _model(ns)
    cluster = _cluster(ns)
    work = _workload(ns, model, sample, tokens)
    params = sum(p.numel() for p in model.parameters())
    devices = cluster.describe(speeds=not ns.profile)
    measured = f"; layer times measured on {ns.device or 'cpu'}" if ns.profile else ""
    print(f"{ns.model}: {len(work.costs)} layers, {params:,} parameters; {devices}{measured}")
    if ns.tp is not None and ns.tp > 1 and isinstance(model, GPT) and ns.tp not in dict(work.tensor_parallel):
        # a degree the workload did not describe: what the GPT's plan makes of it (or why it cannot)
        traffic = layer_traffic(layers_of(model), gpt_parallel.plan, ns.tp)
        work = dataclasses.replace(work, tensor_parallel=(*work.tensor_parallel, (ns.tp, traffic)))
    result = plan(work, cluster, options=_pinned(ns, work, cluster))
    _show(result, work, ns.top)
    if result.best is None:
        least = result.smallest_memory
        need = f"; it would need at least {format_bytes(least)} per device" if least else ""
        print(f"no layout fits {cluster.n_devices} devices{need}")
        return 1
    _write_best(ns, result, work, tokens, cluster)
    return 0
