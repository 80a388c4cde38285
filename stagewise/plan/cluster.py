"""The devices a job runs on: memory, speed and memory bandwidth per device, and the links between them."""

from __future__ import annotations

import itertools
import math
import re
from dataclasses import dataclass

from stagewise.errors import whole_number
from stagewise.units import format_bytes, parse_bytes


@dataclass(frozen=True)
class Device:
    """One kind of accelerator."""

    memory: float
    """Bytes of memory."""
    flops: float
    """Sustained floating-point operations per second of training kernels (not the datasheet peak)."""
    memory_bandwidth: float = 2e12
    """Bytes per second to and from its memory (the optimizer step is bound by it)."""

    def __post_init__(self) -> None:
        for name in ("memory", "flops", "memory_bandwidth"):
            if not 0 < getattr(self, name) < math.inf:
                raise ValueError(f"a device's {name} must be positive and finite, got {getattr(self, name)}")


@dataclass(frozen=True)
class Cluster:
    """The devices in rank order (rank ``r`` uses ``devices[r]``) and the links between them."""

    devices: tuple[Device, ...]
    link_bandwidth: float = 50e9
    """Bytes per second between the ranks of adjacent pipeline stages."""
    link_latency: float = 20e-6
    """Seconds per point-to-point message, whatever its size."""
    network_bandwidth: float = 25e9
    """Bytes per second each device sends in a ring collective across nodes (DDP's all-reduce, FSDP's
    all-gather and reduce-scatter)."""
    gpus_per_node: int = 8
    """Devices per node, in rank order: a tensor-parallel group never crosses a node."""
    intra_node_bandwidth: float = 300e9
    """Bytes per second each device sends in a ring collective within a node (NVLink class; tensor parallelism's
    all-reduces, and FSDP's collectives where their group fits in a node)."""
    sharding_bandwidth: float | None = None
    """Bytes per second of FSDP's all-gather and reduce-scatter per device (of its shard), where they run slower
    than the ring bandwidth of their group (gloo's, about a quarter of its all-reduce's); None: that bandwidth, as
    NCCL's do."""
    host_memory: float | None = None
    """Bytes of host memory per node, shared by its GPUs, for offloaded optimizer state and activations; None:
    offloading is not considered."""
    host_bandwidth: float | None = None
    """Bytes per second each device moves to or from host memory (PCIe class, e.g. 25e9); None: offloading is
    not considered."""
    host_optimizer_bandwidth: float = 50e9
    """Bytes per second per node at which an offloaded optimizer reads and writes its state on the host (a
    server's CPUs stepping Adam), shared by the node's GPUs."""
    host_cores: int | None = None
    """CPU cores that the job's ranks compute on, where they are CPU processes on one machine (gloo): with more
    ranks than cores they take turns, and a rank computing while others wait runs faster than one among all busy
    (:class:`~stagewise.schedule.SharedCores`, with :attr:`Workload.profiled_processes`). None: each device
    computes on its own, as GPUs do."""
    side_stream: bool = True
    """Whether a device overlaps copies and collectives with its compute (a GPU's side streams): FSDP's
    per-action gathers and activation offloading cost only what they take beyond the compute beside them.
    False (gloo on CPUs): they add to it."""

    def __post_init__(self) -> None:
        if not self.devices:
            raise ValueError("a cluster needs at least one device")
        whole_number("gpus_per_node", self.gpus_per_node, least=1, fix="give the devices of one node (8 by default)")
        if self.sharding_bandwidth is not None and not 0 < self.sharding_bandwidth < math.inf:
            raise ValueError(f"sharding_bandwidth must be positive and finite or None, got {self.sharding_bandwidth}")
        for name in ("link_bandwidth", "network_bandwidth", "intra_node_bandwidth", "host_optimizer_bandwidth"):
            if not 0 < getattr(self, name) < math.inf:
                raise ValueError(f"{name} must be positive and finite, got {getattr(self, name)}")
        for name in ("host_memory", "host_bandwidth"):
            value = getattr(self, name)
            if value is not None and not 0 < value < math.inf:
                raise ValueError(f"{name} must be positive and finite, or None (no offloading), got {value}")
        if (self.host_memory is None) != (self.host_bandwidth is None):
            given, missing = ("host_memory", "host_bandwidth") if self.host_bandwidth is None else (
                "host_bandwidth", "host_memory")  # fmt: skip
            raise ValueError(
                f"{given} is given but {missing} is not; offloading needs both (--host-memory and --host-bandwidth)"
            )
        if self.host_cores is not None:
            whole_number("host_cores", self.host_cores, least=1, fix="give the CPU cores the ranks share, or None")
            if self.n_devices > self.gpus_per_node:
                raise ValueError(
                    f"host_cores models one machine's ranks sharing its cores, but the cluster has {self.n_devices} "
                    f"devices over nodes of {self.gpus_per_node}; give gpus_per_node={self.n_devices}, or no host_cores"
                )
        if not 0 <= self.link_latency < math.inf:  # also refuses NaN
            raise ValueError(f"link_latency must be >= 0 and finite, got {self.link_latency}")

    @property
    def n_devices(self) -> int:
        return len(self.devices)

    @property
    def offloads(self) -> bool:
        """Whether offloading to host memory is considered: the host's memory and bandwidth are given."""
        return self.host_memory is not None and self.host_bandwidth is not None

    @property
    def host_share(self) -> float:
        """Host bytes one device may fill: the node's host memory over its GPUs (0 where none is given)."""
        return 0.0 if self.host_memory is None else self.host_memory / self.gpus_per_node

    def bandwidth(self, span: int) -> float:
        """Ring bandwidth of a group of ranks ``span`` apart at most in rank order: within a node, or across."""
        return self.intra_node_bandwidth if span <= self.gpus_per_node else self.network_bandwidth

    def stage_devices(self, pp: int, dp: int) -> list[Device]:
        """Per pipeline rank: the weakest of the ``dp`` devices of its stage (its replicas, shards and tensor-parallel
        ranks: ``dp x fsdp x tp``; each waits for the slowest).

        Ranks are laid out pipeline outermost, as in :class:`stagewise.comm.Layout`:
        the ranks of stage ``s`` are ``s * dp .. (s + 1) * dp - 1``.
        """
        if pp * dp != self.n_devices:
            raise ValueError(
                f"pp={pp} x {dp} ranks per stage = {pp * dp} ranks, but the cluster has {self.n_devices} devices"
            )
        out = []
        for s in range(pp):
            group = self.devices[s * dp : (s + 1) * dp]
            out.append(
                Device(
                    memory=min(d.memory for d in group),
                    flops=min(d.flops for d in group),
                    memory_bandwidth=min(d.memory_bandwidth for d in group),
                )
            )
        return out

    def describe(self, *, speeds: bool = True) -> str:
        """The devices in rank order, equal neighbours as one group: ``4 x 80.00 GiB at 4e+14 FLOP/s, ...``;
        without ``speeds`` (times measured, not derived from FLOP/s) only their memory."""
        bandwidths = {d.memory_bandwidth for d in self.devices}
        groups = []
        for device, run in itertools.groupby(self.devices):
            text = f"{len(list(run))} x {format_bytes(device.memory)}"
            if speeds:
                text += f" at {device.flops:.3g} FLOP/s"
            if len(bandwidths) > 1:
                text += f" and {format_bytes(device.memory_bandwidth)}/s"
            groups.append(text)
        return ", ".join(groups)


_GROUP = re.compile(r"^\s*(\d+)\s*x\s*([^@]+?)\s*@\s*([0-9.eE+-]+)\s*$")


def parse_devices(text: str) -> tuple[Device, ...]:
    """Devices from ``"COUNTxMEMORY@FLOPS,..."``, e.g. ``"4x80GiB@400e12,4x40GiB@150e12"`` (rank order)."""
    devices: list[Device] = []
    for part in text.split(","):
        match = _GROUP.match(part)
        if match is None:
            raise ValueError(
                f"cannot read the device group {part.strip()!r}; write COUNTxMEMORY@FLOPS, e.g. 8x80GiB@400e12"
            )
        count, memory = int(match[1]), parse_bytes(match[2])
        try:
            flops = float(match[3])
        except ValueError:
            raise ValueError(
                f"cannot read the FLOP/s {match[3]!r} of the device group {part.strip()!r}; write COUNTxMEMORY@FLOPS, "
                "e.g. 8x80GiB@400e12"
            ) from None
        if count < 1:
            raise ValueError(f"a device group needs at least one device, got {count} in {part.strip()!r}")
        devices += [Device(memory, flops)] * count
    return tuple(devices)
