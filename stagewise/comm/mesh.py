"""init_mesh(): the job's ("pp", "dp", "fsdp", "tp") DeviceMesh over groups of its own, and each rank's place in it."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import timedelta
from typing import get_args

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from stagewise.comm.default_group import Backend, backend_and_device, init_default_group, joined, world_group
from stagewise.comm.layout import DIMENSIONS, Coords, Layout, layout_for
from stagewise.comm.timeouts import DEFAULT_TIMEOUT, checked_timeout

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PipelineMesh:
    """This process's place in the job: the DeviceMesh, the layout, its device and backend."""

    device_mesh: DeviceMesh
    """Dimensions ("pp", "dp", "fsdp", "tp"), pipeline outermost."""
    layout: Layout
    rank: int
    """This process's global rank."""
    device: torch.device
    """Where this rank computes: ``cuda:LOCAL_RANK`` under NCCL, the CPU under gloo."""
    backend: Backend
    timeout: float
    """Seconds: the bound on every collective and point-to-point wait (see :mod:`stagewise.comm.timeouts`)."""
    batch_group: dist.ProcessGroup
    """The ``dp x fsdp`` ranks of this rank's stage with its ``tp_rank``: each takes its own share of the batch."""
    experts: ExpertGroups | None = None
    """With ``layout.ep > 1``: the groups of expert parallelism; None without."""

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
    def line(self) -> int:
        """The pipeline this rank belongs to (its replica when nothing is sharded)."""
        return self.layout.line(self.rank)

    @property
    def batch_index(self) -> int:
        """Which share of the global batch this rank's pipeline takes (see :attr:`Layout.batch_shards`)."""
        return self.layout.batch_index(self.rank)

    def share(self, global_batch: int) -> slice:
        """This rank's share of a global batch of ``global_batch`` samples: its pipeline's, one of
        :attr:`Layout.batch_shards` equal shares in :attr:`batch_index` order (``tp`` ranks take the same one)."""
        shards = self.layout.batch_shards
        if global_batch % shards:
            raise ValueError(
                f"a global batch of {global_batch} does not divide into the {shards} shares of dp x fsdp = "
                f"{self.layout.dp} x {self.layout.fsdp}; use a multiple of {shards}"
            )
        size = global_batch // shards
        return slice(self.batch_index * size, (self.batch_index + 1) * size)

    @property
    def prev_rank(self) -> int | None:
        return self.layout.prev_rank(self.rank)

    @property
    def next_rank(self) -> int | None:
        return self.layout.next_rank(self.rank)

    def close(self) -> None:
        """Destroy the mesh's own groups (a dimension that spans the world may use the default group, which
        stays); their threads and sockets go when the mesh itself does. Closing again does nothing."""
        groups = []
        for name in DIMENSIONS:
            try:
                groups.append(self.device_mesh.get_group(name))
            except RuntimeError:  # destroyed by an earlier close: torch no longer resolves its name
                continue
        groups.append(self.batch_group)
        if self.experts is not None:
            groups += [self.experts.ep, self.experts.replicas, self.experts.backward]
        done: set[int] = set()
        for group in groups:
            if group is dist.group.WORLD or id(group) in done:
                continue
            done.add(id(group))
            try:
                dist.destroy_process_group(group)
            except (RuntimeError, ValueError):  # destroyed already (the batch group may be the dp group)
                continue

    @property
    def pp_group(self) -> dist.ProcessGroup:
        """This rank's pipeline: the ranks of its line, one per stage."""
        return self.device_mesh.get_group("pp")

    @property
    def dp_group(self) -> dist.ProcessGroup:
        """This rank's data-parallel group: the replicas of its stage's shard."""
        return self.device_mesh.get_group("dp")

    def describe(self) -> str:
        """One line: backend, devices found, layout, and this rank's place."""
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        c = self.coords
        place = f"stage {c.stage}, replica {c.replica}"
        if self.layout.fsdp > 1:
            place += f", shard {c.shard}"
        if self.layout.tp > 1:
            place += f", tp rank {c.tp_rank}"
        return (
            f"backend {self.backend}, {gpus} CUDA device(s) found, {self.layout.describe()} on "
            f"{self.layout.world_size} processes; rank {self.rank} is {place}, on {self.device}"
        )


@dataclass(frozen=True)
class ExpertGroups:
    """Expert parallelism's groups (see :attr:`Layout.expert_shape`)."""

    mesh: DeviceMesh
    """The 1-D ``("ep",)`` mesh of the ranks this rank's experts are split over (the placement of their DTensors)."""
    replicas: dist.ProcessGroup
    """The ranks of this rank's stage holding the same experts as this one, over which their gradients are summed
    (this rank alone when ``dp x fsdp = ep``)."""
    backward: dist.ProcessGroup
    """The ``ep`` ranks again, in a group of their own for the all-to-alls of backwards: a forward and a backward
    that run at once (see :mod:`stagewise.pipeline.execution.pairs`) each keep their collectives in order."""

    @property
    def ep(self) -> dist.ProcessGroup:
        return self.mesh.get_group()


@dataclass(frozen=True)
class _Groups:
    mesh: DeviceMesh
    batch: dist.ProcessGroup
    experts: ExpertGroups | None


def _device_mesh(layout: Layout, device: torch.device, backend: Backend, wait: float, *, world: bool) -> _Groups:
    """The ("pp", "dp", "fsdp", "tp") DeviceMesh over groups whose waits are bounded by ``wait`` seconds, and the
    group of each stage's ``dp x fsdp`` ranks that take their own shares of the batch.

    ``init_device_mesh`` gives a dimension that is not the whole world a group with torch's default timeout
    (30 minutes), so its collectives (the loss broadcast, DDP's all-reduce, FSDP's all-gather) would not time
    out when the transfers do; the groups are made here, collectively, with the mesh's own.
    """
    shape = tuple(getattr(layout, name) for name in DIMENSIONS)
    grid = torch.arange(layout.world_size).reshape(shape)
    rank = dist.get_rank()

    def group_of(lines: list[list[int]], *, own: bool = False) -> dist.ProcessGroup:
        if world and len(lines) == 1 and not own:  # the whole world: the default group, made with the same bound
            return world_group()
        found: dist.ProcessGroup | None = None
        for ranks in lines:  # every rank makes every group, in the same order
            group = dist.new_group(ranks, timeout=timedelta(seconds=wait), backend=backend)
            if rank in ranks:
                found = group
        assert found is not None  # every rank lies on one line of each dimension
        return found

    mine = [group_of(grid.movedim(d, -1).reshape(-1, shape[d]).tolist()) for d in range(len(DIMENSIONS))]
    mesh = DeviceMesh.from_group(mine, device.type, mesh=grid, mesh_dim_names=DIMENSIONS)
    if layout.fsdp == 1:
        batch = mine[1]  # the dp group itself
    else:  # the ranks of a stage with one tp rank: grid[s, :, :, t]
        batch = group_of(grid.permute(0, 3, 1, 2).reshape(-1, layout.batch_shards).tolist())
    experts = None
    if layout.ep > 1:
        pp, dp, fsdp, ep, tp = layout.expert_shape
        cut = grid.reshape(pp, dp * fsdp, ep, tp)
        lines = cut.movedim(2, -1).reshape(-1, ep)
        ep_mesh = DeviceMesh.from_group(
            group_of(lines.tolist()), device.type, mesh=next(line for line in lines if rank in line),
            mesh_dim_names=("ep",),
        )  # fmt: skip
        replicas = group_of(cut.movedim(1, -1).reshape(-1, dp * fsdp).tolist())
        experts = ExpertGroups(ep_mesh, replicas, group_of(lines.tolist(), own=True))  # never shared with another
    return _Groups(mesh, batch, experts)


def init_mesh(
    pp: int | None = None,
    dp: int | None = 1,
    *,
    fsdp: int = 1,
    tp: int = 1,
    ep: int = 1,
    backend: Backend | None = None,
    timeout: float = DEFAULT_TIMEOUT,
) -> PipelineMesh:
    """Join the job started by torchrun (or :func:`stagewise.comm.launch`) and build its mesh.

    Reads RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and
    MASTER_PORT; initialises the default process group unless it already is;
    picks NCCL when CUDA has a GPU for each local rank (and makes
    ``cuda:LOCAL_RANK`` this process's device), gloo otherwise; and returns
    the ("pp", "dp", "fsdp", "tp") DeviceMesh, pipeline outermost and tensor
    parallelism innermost as in torchtitan (see :class:`Layout`): with
    ``fsdp = tp = 1``, rank ``r`` runs stage ``r // dp`` of replica ``r % dp``.
    Either of ``pp`` and ``dp`` may be None: it is then the world size divided
    by the other dimensions (``init_mesh()`` alone is one pipeline over all
    processes). ``fsdp`` ranks of each replica shard its stages' parameters
    (:func:`torch.distributed.fsdp.fully_shard`), and ``tp`` ranks split each
    layer (tensor parallelism); either may be 1.

    ``timeout`` (seconds) bounds every collective of the mesh's groups and,
    when this call initialises the default group, its rendezvous too: every
    process must have joined within it (torch's rendezvous takes the group's
    bound).

    Raises:
        ValueError: ``pp * dp * fsdp * tp`` is not the world size, or the environment is incomplete.
    """
    seconds = checked_timeout(timeout)
    if backend not in (None, *get_args(Backend)):
        raise ValueError(f"backend must be one of {list(get_args(Backend))} or None (chosen for you), got {backend!r}")
    world, rank = joined()
    layout = layout_for(pp, dp, world, fsdp, tp, ep)
    chosen, device = backend_and_device(backend, world)
    made = not dist.is_initialized()
    if made:
        init_default_group(chosen, device, world, rank, seconds)
    groups = _device_mesh(layout, device, chosen, seconds, world=made)
    result = PipelineMesh(groups.mesh, layout, rank, device, chosen, seconds, groups.batch, groups.experts)
    log.info("%s", result.describe())
    return result
