"""init_mesh(): the process group and a ("pp", "dp") DeviceMesh, with each rank's stage and replica."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Literal, get_args

import torch
import torch.distributed as dist
from torch.distributed import PrefixStore, Store, TCPStore  # type: ignore[attr-defined]  # public, not re-exported
from torch.distributed.device_mesh import DeviceMesh

from stagewise.comm.timeouts import DEFAULT_TIMEOUT, checked_timeout

log = logging.getLogger(__name__)

Backend = Literal["gloo", "nccl"]
"""The process-group backends stagewise uses: gloo on CPU, NCCL on GPU."""

_TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _check_dim(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")


@dataclass(frozen=True)
class Coords:
    """Where a rank sits: which pipeline stage it runs and which data-parallel replica it belongs to."""

    stage: int
    replica: int


@dataclass(frozen=True)
class Layout:
    """The ``pp x dp`` grid of ranks, pipeline outermost: ``rank = stage * dp + replica``."""

    pp: int
    """Pipeline stages (the depth of each pipeline)."""
    dp: int
    """Data-parallel replicas of each stage."""

    def __post_init__(self) -> None:
        _check_dim("pp", self.pp)
        _check_dim("dp", self.dp)

    @property
    def world_size(self) -> int:
        return self.pp * self.dp

    def coords(self, rank: int) -> Coords:
        """The stage and replica of global ``rank``."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside a pp={self.pp} x dp={self.dp} mesh of {self.world_size}")
        return Coords(stage=rank // self.dp, replica=rank % self.dp)

    def rank(self, stage: int, replica: int) -> int:
        """The global rank running ``stage`` in ``replica``."""
        if not (0 <= stage < self.pp and 0 <= replica < self.dp):
            raise ValueError(f"(stage {stage}, replica {replica}) is outside a pp={self.pp} x dp={self.dp} mesh")
        return stage * self.dp + replica

    def next_rank(self, rank: int) -> int | None:
        """The rank of the next stage in the same replica, or None on the last stage."""
        c = self.coords(rank)
        return self.rank(c.stage + 1, c.replica) if c.stage + 1 < self.pp else None

    def prev_rank(self, rank: int) -> int | None:
        """The rank of the previous stage in the same replica, or None on the first stage."""
        c = self.coords(rank)
        return self.rank(c.stage - 1, c.replica) if c.stage > 0 else None

    def pipeline_ranks(self, replica: int) -> tuple[int, ...]:
        """The ranks of one pipeline, stage 0 first."""
        return tuple(self.rank(s, replica) for s in range(self.pp))

    def replica_ranks(self, stage: int) -> tuple[int, ...]:
        """The ranks holding copies of one stage: its data-parallel group."""
        return tuple(self.rank(stage, r) for r in range(self.dp))


@dataclass(frozen=True)
class PipelineMesh:
    """This process's place in the job: the DeviceMesh, the layout, its device and backend."""

    device_mesh: DeviceMesh
    """Dimensions ("pp", "dp"), pipeline outermost."""
    layout: Layout
    rank: int
    """This process's global rank."""
    device: torch.device
    """Where this rank computes: ``cuda:LOCAL_RANK`` under NCCL, the CPU under gloo."""
    backend: Backend
    timeout: float
    """Seconds: the bound on every collective and point-to-point wait (see :mod:`stagewise.comm.timeouts`)."""

    @property
    def coords(self) -> Coords:
        return self.layout.coords(self.rank)

    @property
    def stage(self) -> int:
        return self.coords.stage

    @property
    def replica(self) -> int:
        return self.coords.replica

    @property
    def prev_rank(self) -> int | None:
        return self.layout.prev_rank(self.rank)

    @property
    def next_rank(self) -> int | None:
        return self.layout.next_rank(self.rank)

    def close(self) -> None:
        """Destroy the mesh's own groups (a dimension that spans the world may use the default group, which
        stays); their threads and sockets go when the mesh itself does. Closing again does nothing."""
        for name in ("pp", "dp"):
            try:
                group = self.device_mesh.get_group(name)
            except RuntimeError:  # destroyed by an earlier close: torch no longer resolves its name
                continue
            if group is not dist.group.WORLD:
                dist.destroy_process_group(group)

    @property
    def pp_group(self) -> dist.ProcessGroup:
        """This rank's pipeline: the ranks of its replica, one per stage."""
        return self.device_mesh.get_group("pp")

    @property
    def dp_group(self) -> dist.ProcessGroup:
        """This rank's data-parallel group: the replicas of its stage."""
        return self.device_mesh.get_group("dp")

    def describe(self) -> str:
        """One line: backend, devices found, layout, and this rank's place."""
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        return (
            f"backend {self.backend}, {gpus} CUDA device(s) found, pp={self.layout.pp} x dp={self.layout.dp} "
            f"on {self.layout.world_size} processes; rank {self.rank} is stage {self.stage}, "
            f"replica {self.replica}, on {self.device}"
        )


def _env_int(name: str) -> int:
    value = os.environ[name]
    try:
        return int(value)
    except ValueError as err:
        raise ValueError(f"environment variable {name}={value!r} is not an integer") from err


def _attempt_store(world: int, timeout: float) -> Store | None:
    """Under torchrun's agent store, a store whose keys belong to this restart attempt alone.

    After a restart the agent hands the new workers the same store as the
    failed attempt's, whose keys still hold the dead processes' addresses;
    gloo would try to connect to them. Prefixing the keys with the attempt
    keeps each attempt's rendezvous apart. Elsewhere: None (``env://``).
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or "TORCHELASTIC_RESTART_COUNT" not in os.environ:
        return None
    attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
    client = TCPStore(
        os.environ["MASTER_ADDR"], _env_int("MASTER_PORT"), world, is_master=False, timeout=timedelta(seconds=timeout)
    )
    return PrefixStore(f"stagewise/attempt_{attempt}", client)


def choose_backend(local_world_size: int) -> Backend:
    """NCCL when CUDA has a GPU for every local rank, gloo otherwise."""
    if torch.cuda.is_available() and torch.cuda.device_count() >= local_world_size:
        return "nccl"
    return "gloo"


def _fill(pp: int | None, dp: int | None, world: int) -> Layout:
    """The layout for ``world`` processes, a ``None`` dimension being the world size over the other."""
    if pp is None and dp is None:
        return Layout(world, 1)
    if pp is not None and dp is not None:
        return Layout(pp, dp)
    name, other, given = ("pp", "dp", pp) if dp is None else ("dp", "pp", dp)
    assert given is not None
    _check_dim(name, given)
    if world % given:
        divisors = [d for d in range(1, world + 1) if world % d == 0]
        raise ValueError(
            f"{name}={given} does not divide the world size {world}, so no {other} fits; "
            f"choose {name} among {divisors}, or launch a multiple of {given} processes"
        )
    return Layout(given, world // given) if name == "pp" else Layout(world // given, given)


def _world() -> dist.ProcessGroup:
    group = dist.group.WORLD
    assert group is not None  # initialised before any mesh is built
    return group


def _device_mesh(layout: Layout, device: torch.device, backend: Backend, wait: float, *, world: bool) -> DeviceMesh:
    """The ("pp", "dp") DeviceMesh over groups whose waits are bounded by ``wait`` seconds.

    ``init_device_mesh`` gives a dimension that is not the whole world a group with torch's default timeout
    (30 minutes), so its collectives (the loss broadcast, DDP's all-reduce) would not time out when the
    transfers do; the groups are made here, collectively, with the mesh's own.
    """
    grid = torch.arange(layout.world_size).reshape(layout.pp, layout.dp)
    rank = dist.get_rank()
    mine: list[dist.ProcessGroup] = []
    for lines in (grid.T.tolist(), grid.tolist()):  # each replica's pipeline, then each stage's replicas
        if world and len(lines) == 1:  # the whole world: the default group, made with the same bound
            mine.append(_world())
            continue
        for ranks in lines:  # every rank makes every group, in the same order
            group = dist.new_group(ranks, timeout=timedelta(seconds=wait), backend=backend)
            if rank in ranks:
                mine.append(group)
    return DeviceMesh.from_group(mine, device.type, mesh=grid, mesh_dim_names=("pp", "dp"))


def _joined() -> tuple[int, int]:
    """(world size, rank): the default group's when it is initialised, else the torchrun environment's."""
    if dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    missing = [name for name in _TORCHRUN_ENV if name not in os.environ]
    if missing:
        raise ValueError(
            f"init_mesh needs the torchrun environment, but {', '.join(missing)} "
            f"{'is' if len(missing) == 1 else 'are'} not set; start the processes with torchrun "
            "or stagewise.comm.launch"
        )
    return _env_int("WORLD_SIZE"), _env_int("RANK")


def _layout(pp: int | None, dp: int | None, world: int) -> Layout:
    """The ``pp x dp`` layout of ``world`` processes (see :func:`_fill`), refused unless it covers them all."""
    layout = _fill(pp, dp, world)
    if layout.world_size != world:
        raise ValueError(
            f"pp={layout.pp} x dp={layout.dp} = {layout.world_size} processes, but the world size is {world}; "
            f"choose pp and dp whose product is {world}, or launch {layout.world_size} processes"
        )
    return layout


def _backend_and_device(backend: Backend | None, world: int) -> tuple[Backend, torch.device]:
    """The backend (the default group's, else ``backend`` or :func:`choose_backend`'s) and this rank's device:
    ``cuda:LOCAL_RANK`` under NCCL, made current, else the CPU."""
    local_rank = _env_int("LOCAL_RANK") if "LOCAL_RANK" in os.environ else 0
    local_world = _env_int("LOCAL_WORLD_SIZE") if "LOCAL_WORLD_SIZE" in os.environ else world
    chosen: Backend
    if dist.is_initialized():
        chosen = "nccl" if dist.get_backend() == "nccl" else "gloo"
    else:
        chosen = backend or choose_backend(local_world)
    if backend is not None and backend != chosen:
        raise ValueError(f"the process group already uses {chosen}, not the requested {backend}")
    if chosen == "gloo":
        return chosen, torch.device("cpu")
    usable = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if local_rank >= usable:
        raise ValueError(
            f"backend 'nccl' needs a CUDA device for local rank {local_rank}, but this machine has {usable} usable "
            "GPUs; use backend='gloo' on the CPU, or launch at most one process per GPU"
        )
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
    return chosen, device


def _init_default_group(backend: Backend, device: torch.device, world: int, rank: int, wait: float) -> None:
    """Initialise the default process group, its rendezvous bounded by ``wait`` seconds (torch's takes the group's)."""
    store = _attempt_store(world, wait)
    dist.init_process_group(
        backend,
        timeout=timedelta(seconds=wait),
        device_id=device if backend == "nccl" else None,
        store=store,
        rank=rank if store is not None else -1,
        world_size=world if store is not None else -1,
    )


def init_mesh(
    pp: int | None = None,
    dp: int | None = 1,
    *,
    backend: Backend | None = None,
    timeout: float = DEFAULT_TIMEOUT,
) -> PipelineMesh:
    """Join the job started by torchrun (or :func:`stagewise.comm.launch`) and build its mesh.

    Reads RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and
    MASTER_PORT; initialises the default process group unless it already is;
    picks NCCL when CUDA has a GPU for each local rank (and makes
    ``cuda:LOCAL_RANK`` this process's device), gloo otherwise; and returns
    the ("pp", "dp") DeviceMesh, pipeline outermost as in torchtitan, so rank
    ``r`` runs stage ``r // dp`` of replica ``r % dp``. Either of ``pp`` and
    ``dp`` may be None: it is then the world size divided by the other
    (``init_mesh()`` alone is one pipeline over all processes).

    ``timeout`` (seconds) bounds every collective of the mesh's groups and,
    when this call initialises the default group, its rendezvous too: every
    process must have joined within it (torch's rendezvous takes the group's
    bound).

    Raises:
        ValueError: ``pp * dp`` is not the world size, or the environment is incomplete.
    """
    seconds = checked_timeout(timeout)
    if backend not in (None, *get_args(Backend)):
        raise ValueError(f"backend must be one of {list(get_args(Backend))} or None (chosen for you), got {backend!r}")
    world, rank = _joined()
    layout = _layout(pp, dp, world)
    chosen, device = _backend_and_device(backend, world)
    made = not dist.is_initialized()
    if made:
        _init_default_group(chosen, device, world, rank, seconds)
    mesh = _device_mesh(layout, device, chosen, seconds, world=made)
    result = PipelineMesh(mesh, layout, rank, device, chosen, seconds)
    log.info("%s", result.describe())
    return result
