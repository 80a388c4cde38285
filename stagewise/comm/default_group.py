"""The job's default process group: the torchrun environment it is joined from, the backend, and this rank's device."""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Literal

import torch
import torch.distributed as dist
from torch.distributed import PrefixStore, Store, TCPStore  # type: ignore[attr-defined]  # public, not re-exported

Backend = Literal["gloo", "nccl"]
"""The process-group backends stagewise uses: gloo on CPU, NCCL on GPU."""

_TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


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


def world_group() -> dist.ProcessGroup:
    """The default process group (initialised: by :func:`~stagewise.comm.mesh.init_mesh`, or before it)."""
    group = dist.group.WORLD
    assert group is not None  # initialised before any mesh is built
    return group


def joined() -> tuple[int, int]:
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


def backend_and_device(backend: Backend | None, world: int) -> tuple[Backend, torch.device]:
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


def init_default_group(backend: Backend, device: torch.device, world: int, rank: int, wait: float) -> None:
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
