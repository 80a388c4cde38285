"""The launcher: run a function or a module on local processes through torchrun's elastic agent."""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import socket
import sys
import tempfile
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch
from typing_extensions import Unpack

from stagewise.comm import rendezvous
from stagewise.comm.cpu_pinning import cpu_shares
from stagewise.comm.job_identity import endpoint_run_id
from stagewise.comm.launch_failures import LaunchError, failures_of
from stagewise.comm.launch_options import LaunchOptions, checked_options, child_environment
from stagewise.comm.launched_process import FAILURE_GRACE, LaunchedFunction
from stagewise.comm.process_tree import RANKS_DIR
from stagewise.comm.stop_signals import passing_stop_signals

log = logging.getLogger(__name__)

T = TypeVar("T")

LOOPBACK = "127.0.0.1"

FORKSERVER_PRELOAD = ("torch", "torch.distributed", "stagewise.comm")
"""Modules the fork server imports once, before it forks any process, with the launched function's own module."""


def free_port(host: str = LOOPBACK) -> int:
    """A TCP port that is free on ``host`` right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def _environment(values: Mapping[str, str]) -> Iterator[None]:
    """Set environment variables for the children spawned inside, then restore ours."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, old in saved.items():
            if old is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = old


def launch(fn: Callable[..., T], nprocs: int, *args: Any, **options: Unpack[LaunchOptions]) -> dict[int, T]:
    """Run ``fn(*args)`` on ``nprocs`` local processes and return each global rank's result.

    The processes are started and watched by torchrun's elastic agent, which
    sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT (read by
    :func:`stagewise.comm.init_mesh`). On one node the rendezvous is a store
    of this process's own on a socket it binds to 127.0.0.1, so nothing
    listens beyond loopback (:mod:`stagewise.comm.rendezvous`); for several
    nodes, give every node the same ``rdzv_endpoint`` and ``nnodes``, and
    ``is_host=True`` on the node that should host torch's c10d rendezvous
    store (see :class:`~stagewise.comm.launch_options.LaunchOptions`), on a trusted network. ``fn`` must be
    importable by the spawned processes (defined at the top level of a module).

    When a rank fails, the agent stops the others and this raises
    :class:`LaunchError` with the failing rank's traceback; with
    ``max_restarts`` the agent first restarts the whole group that many times.
    """
    grace = FAILURE_GRACE + 2 * options.get("monitor_interval", 0.1)  # the agent looks once per interval
    entry = LaunchedFunction(fn, child_environment(options), options.get("threads", 1), grace)
    return _run(entry, args, nprocs, options)


def launch_module(module: str, argv: Sequence[str], nprocs: int, **options: Unpack[LaunchOptions]) -> None:
    """Run ``python -m module *argv`` on ``nprocs`` local processes, as :func:`launch` runs a function."""
    if options.get("pin_cores"):
        raise ValueError("pin_cores applies to launch(fn) only: a module's interpreter starts before it could be set")
    if options.get("start_method", "spawn") != "spawn":
        raise ValueError(
            f"launch_module starts fresh interpreters; start_method={options.get('start_method')!r} applies to "
            "launch(fn) only: leave it out"
        )
    _run(sys.executable, ("-u", "-m", module, *argv), nprocs, options)


def _config(nprocs: int, options: LaunchOptions, logs: str) -> LaunchConfig:
    """The elastic agent's configuration: the rendezvous (one node: our own on loopback), restarts, logs."""
    nnodes = options.get("nnodes", 1)
    is_host = options.get("is_host")
    endpoint = options.get("rdzv_endpoint") or f"{LOOPBACK}:0"
    host = endpoint.rsplit(":", 1)[0]
    if nnodes == 1:
        rendezvous.register()
        backend = rendezvous.BACKEND
    else:
        backend = "c10d"
        log.warning(
            "rendezvous of %d nodes over c10d at %s: every node, and anyone else who reaches that port, can join; "
            "run it on a trusted network, with a run id of its own per job",
            nnodes,
            endpoint,
        )
    return LaunchConfig(
        min_nodes=nnodes,
        max_nodes=nnodes,
        nproc_per_node=nprocs,
        run_id=options.get("run_id")
        or (endpoint_run_id(endpoint) if nnodes > 1 else f"stagewise-{uuid.uuid4().hex[:12]}"),
        rdzv_backend=backend,
        rdzv_endpoint=endpoint,
        rdzv_configs={} if is_host is None else {"is_host": is_host},
        max_restarts=options.get("max_restarts", 0),
        monitor_interval=options.get("monitor_interval", 0.1),
        start_method=options.get("start_method", "spawn"),
        signals_to_handle="SIGHUP,SIGQUIT" if options.get("pass_stop_signals") else "SIGTERM,SIGINT,SIGHUP,SIGQUIT",
        local_addr=host if host in (LOOPBACK, "localhost") else None,
        logs_specs=DefaultLogsSpecs(log_dir=logs, tee=Std.ALL)
        if options.get("tee", True)
        else DefaultLogsSpecs(log_dir=logs, redirects=Std.NONE, tee=Std.NONE),
    )


def _run(
    entrypoint: LaunchedFunction | str, args: Sequence[Any], nprocs: int, options: LaunchOptions
) -> dict[int, Any]:
    checked_options(nprocs, options)
    children = child_environment(options)
    if isinstance(entrypoint, LaunchedFunction):
        if options.get("pin_cores"):
            entrypoint.cores = cpu_shares(nprocs)
        if options.get("start_method", "spawn") == "forkserver":
            module = entrypoint.fn.__module__
            extra = [module] if module and module != "__main__" else []
            multiprocessing.set_forkserver_preload([*FORKSERVER_PRELOAD, *extra])  # used when the server starts
    with tempfile.TemporaryDirectory(prefix="stagewise-launch-") as logs:
        if isinstance(entrypoint, LaunchedFunction):  # where each process records its rank, for its peers to name it
            entrypoint.env[RANKS_DIR] = str(Path(logs, "ranks"))
            Path(logs, "ranks").mkdir()
        config = _config(nprocs, options, logs)
        try:
            with _environment(children), passing_stop_signals(options.get("pass_stop_signals", False)):
                result = elastic_launch(config, entrypoint)(*args)
        except ChildFailedError as err:
            raise LaunchError(failures_of(err, Path(logs), options.get("layout"))) from None
    return dict(result or {})
