"""Run a function or a module on local processes through torchrun's elastic agent."""

from __future__ import annotations

import contextlib
import functools
import logging
import multiprocessing
import os
import signal
import socket
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from datetime import timedelta
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from types import FrameType
from typing import Any, Literal, TypedDict, TypeVar, get_args

import torch
from torch.distributed import TCPStore  # type: ignore[attr-defined]  # public, not re-exported
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch
from typing_extensions import Unpack

from stagewise.comm import rendezvous
from stagewise.comm.launch_failures import LaunchError, failures_of, report
from stagewise.comm.layout import Layout
from stagewise.comm.process_tree import RANKS_DIR, name_stopped, record_rank, stopped_siblings, wake, watch_parent
from stagewise.comm.shared_memory_files import remove_made

log = logging.getLogger(__name__)

T = TypeVar("T")

LOOPBACK = "127.0.0.1"

StartMethod = Literal["spawn", "forkserver", "fork"]
"""How :func:`launch` starts its processes; see :attr:`LaunchOptions.start_method`."""

FAILURE_GRACE = 1.0
"""Seconds a failing rank of :func:`launch` waits, its report written, before it exits.

Its peers fail soon after it exits, on the closed connection, and the agent
records only the first failure it notices. A rank killed by a signal writes
no report, so its peers wait this long for the agent to notice it first.
"""

SHARED_RUN_ID = "STAGEWISE_SHARED_RUN_ID"
"""Set by :func:`launch` in its processes to the job's id when it made that id from the rendezvous endpoint
(several nodes and no ``run_id``): every job on that endpoint then has the same id (see :func:`shared_run_id`)."""

JOB_TOKEN_KEY = "stagewise/job_token"
"""The key of :func:`job_token`'s value in the store of torchrun's agent."""

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


class LaunchOptions(TypedDict, total=False):
    """How :func:`launch` and :func:`launch_module` start the processes; every key is optional."""

    nnodes: int
    """Nodes in the job (default 1); every node launches with the same value."""
    rdzv_endpoint: str
    """``HOST:PORT`` of the rendezvous. One node: a loopback address (default 127.0.0.1 on a port the launcher
    binds itself; see :mod:`stagewise.comm.rendezvous`). Several nodes: the c10d rendezvous store, which every
    node must reach, so the network between the nodes must be trusted (anyone who reaches the store can take
    part in the job)."""
    is_host: bool
    """True on the node that hosts the rendezvous store when several nodes share an endpoint."""
    run_id: str
    """The job's id; by default random for one node, and made from the endpoint for several, so that each node
    makes the same: then every job on that endpoint has the same id (see :func:`shared_run_id`). Give each job
    its own (a scheduler's job id) to let a restart trust the id alone."""
    max_restarts: int
    """Times the agent restarts the whole group after a failure (default 0)."""
    monitor_interval: float
    """Seconds between the agent's checks of its processes (default 0.1)."""
    device: Literal["cpu", "auto"]
    """"cpu" (default) hides GPUs from the processes so they use gloo; "auto" leaves them visible."""
    threads: int | None
    """OMP_NUM_THREADS of the processes (default 1); None leaves it alone."""
    env: Mapping[str, str]
    """More environment variables for the processes."""
    start_method: StartMethod
    """How :func:`launch` starts the processes. "spawn" (default): each is a fresh interpreter that imports torch
    itself. "forkserver": each is forked from multiprocessing's fork server, which imports torch, stagewise and the
    function's module once per launching process (:data:`FORKSERVER_PRELOAD`), so a process that launches many
    short jobs starts each in a fraction of the time; ``env`` and ``threads`` are then applied in each process
    before the function runs. "fork": each is a copy of the launching process, started at once with whatever it has
    imported (torchrun's ``--start-method fork``); only from a process that has started no CUDA context and runs
    no other threads of its own, as a copy keeps none of them. :func:`launch_module` always starts fresh
    interpreters."""
    layout: Layout
    """The job's ``pp x dp`` layout, so that a failure names the rank's stage and replica."""
    tee: bool
    """Copy each process's output to ours with a ``[rank]`` prefix (default); False lets them write to our
    terminal directly, as a progress bar needs."""
    pin_cores: bool
    """Give each process of :func:`launch` its own equal share of the CPUs this process may run on (Linux
    ``sched_setaffinity``), set before ``fn`` runs so the threads it starts (gloo's among them) stay there
    (default False: the OS places them). On a machine whose cores the ranks fill, this keeps gloo's threads
    from waiting behind another rank's compute."""
    pass_stop_signals: bool
    """Pass SIGTERM and SIGINT on to the processes and let them end as they choose (default False: torch's agent
    stops them at once on either). A process that handles them (``stagewise.run.StopSignals``) can finish its step
    and save; its result comes back as usual."""


def launch(fn: Callable[..., T], nprocs: int, *args: Any, **options: Unpack[LaunchOptions]) -> dict[int, T]:
    """Run ``fn(*args)`` on ``nprocs`` local processes and return each global rank's result.

    The processes are started and watched by torchrun's elastic agent, which
    sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT (read by
    :func:`stagewise.comm.init_mesh`). On one node the rendezvous is a store
    of this process's own on a socket it binds to 127.0.0.1, so nothing
    listens beyond loopback (:mod:`stagewise.comm.rendezvous`); for several
    nodes, give every node the same ``rdzv_endpoint`` and ``nnodes``, and
    ``is_host=True`` on the node that should host torch's c10d rendezvous
    store (see :class:`LaunchOptions`), on a trusted network. ``fn`` must be importable by the spawned
    processes (defined at the top level of a module).

    When a rank fails, the agent stops the others and this raises
    :class:`LaunchError` with the failing rank's traceback; with
    ``max_restarts`` the agent first restarts the whole group that many times.
    """
    grace = FAILURE_GRACE + 2 * options.get("monitor_interval", 0.1)  # the agent looks once per interval
    return _run(_Returning(fn, _children(options), options.get("threads", 1), grace), args, nprocs, options)


class _Returning:
    """Calls ``fn`` in a launched process and checks that its result can travel back to the launcher.

    It first sets the job's environment variables and intra-op threads (a
    process forked from a fork server that imported torch before they were
    set would not see them) and, with ``pin_cores``, the CPUs of every
    thread. The agent pickles each rank's result after ``fn`` has returned,
    outside the scope that records a rank's exception, so an unpicklable
    result (a tensor attached to an autograd graph) would fail without its
    cause. A rank that fails writes its report at once (naming the job's
    ranks that are stopped, whose silence timed it out), then waits
    ``grace`` seconds before it exits (see :data:`FAILURE_GRACE`) and lets
    the stopped ranks run again, so that the agent's SIGTERM ends them. A
    rank interrupted (SIGINT) or calling ``sys.exit`` fails the same way: torch's
    process wrapper would otherwise exit with code 0 and no result, and the
    agent would wait for that result forever. A rank whose launcher is gone
    (killed alone) removes its shared memory and exits within a quarter of a
    second.
    """

    def __init__(self, fn: Callable[..., Any], env: Mapping[str, str], threads: int | None, grace: float) -> None:
        self.fn = fn
        self.env = dict(env)
        self.threads = threads
        self.grace = grace
        self.cores: list[frozenset[int]] = []
        """Per local rank, the CPUs it may run on (``pin_cores``); empty: wherever the OS places it."""
        functools.update_wrapper(self, fn)  # the agent names the job after fn

    def __call__(self, *args: Any) -> Any:
        _fresh_stop_signals()
        watch_parent(remove_made)  # a launcher killed alone: its ranks go too, and their shared memory with them
        os.environ.update(self.env)
        record_rank(int(os.environ.get("RANK", "-1")))
        if self.cores:
            _pin(self.cores[int(os.environ["LOCAL_RANK"])])
        if self.threads is not None:
            torch.set_num_threads(self.threads)
        try:
            try:
                return self._checked(self.fn(*args))
            except KeyboardInterrupt as err:  # torch's process wrapper would exit 0 without a result: a hang
                raise RuntimeError("interrupted (KeyboardInterrupt, or SIGINT)") from err
            except SystemExit as err:  # the same
                raise RuntimeError(
                    f"called sys.exit({err.code!r}) instead of returning; return a value or raise an exception"
                ) from err
        except Exception as err:
            stopped = stopped_siblings()
            name_stopped(err, stopped)  # a peer stopped (SIGSTOP) times a collective out: say which
            report(err)  # now: the agent may stop this process while it waits
            time.sleep(self.grace)
            wake(stopped)  # so that the agent's SIGTERM ends them now, not 30 s later
            raise

    def _checked(self, result: Any) -> Any:
        try:
            ForkingPickler.dumps(result)
        except Exception as err:
            name = getattr(self.fn, "__name__", "the function")
            raise TypeError(
                f"{name} returned a value that cannot be sent back to the launcher: "
                f"{type(err).__name__}: {err}; return plain values (detach tensors, drop modules and groups)"
            ) from err
        return result


def _fresh_stop_signals() -> None:
    """The stop signals' handlers of a fresh interpreter (SIGINT raises KeyboardInterrupt, the others stop the
    process): a process forked from the agent (``start_method="fork"``) would keep the agent's own."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for name in ("SIGTERM", "SIGHUP", "SIGQUIT"):
        signal.signal(getattr(signal, name), signal.SIG_DFL)


def cpu_shares(nprocs: int) -> list[frozenset[int]]:
    """The CPUs of each of ``nprocs`` local processes under ``pin_cores``: equal, disjoint runs of ours, in order."""
    if not hasattr(os, "sched_setaffinity"):
        raise ValueError("pin_cores needs os.sched_setaffinity, which this platform lacks (Linux has it)")
    mine = sorted(os.sched_getaffinity(0))
    if nprocs > len(mine):
        raise ValueError(
            f"pin_cores gives each process at least one CPU, but {nprocs} processes share {len(mine)} CPUs "
            f"({mine}); launch at most {len(mine)} or leave pin_cores out"
        )
    each = len(mine) // nprocs
    return [frozenset(mine[r * each : (r + 1) * each]) for r in range(nprocs)]


def _pin(cpus: frozenset[int]) -> None:
    """Keep every thread of this process, and any it starts later, on ``cpus``."""
    for task in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(task), cpus)
        except ProcessLookupError:  # a thread that ended meanwhile
            continue


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


def _children(options: LaunchOptions) -> dict[str, str]:
    """The environment variables the launched processes get on top of ours."""
    children: dict[str, str] = dict(options.get("env", {}))
    if options.get("device", "cpu") == "cpu":
        children["CUDA_VISIBLE_DEVICES"] = ""
    threads = options.get("threads", 1)
    if threads is not None:
        children["OMP_NUM_THREADS"] = str(threads)
    nnodes, endpoint = options.get("nnodes", 1), options.get("rdzv_endpoint")
    if not options.get("run_id") and isinstance(nnodes, int) and nnodes > 1 and endpoint:
        children[SHARED_RUN_ID] = _endpoint_run_id(endpoint)
    return children


def _endpoint_run_id(endpoint: str) -> str:
    """The job id of several nodes launched without ``run_id``: the same on each node, and for every job there."""
    return f"stagewise-{endpoint}"


def restarts() -> int:
    """How often torchrun's elastic agent has restarted this process's job after a failure (0 in the first
    attempt, and outside torchrun)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def shared_run_id() -> bool:
    """Whether this process's job id (TORCHELASTIC_RUN_ID) may name other jobs as well, so that it cannot tell
    them apart: empty, torchrun's "none" (its default without ``--rdzv-id``, on several nodes), or the id that
    :func:`launch` made from the rendezvous endpoint (:data:`SHARED_RUN_ID`). A random id (what ``launch`` gives
    one node and ``torchrun --standalone`` any job) or one the user gave (``--rdzv-id``, ``run_id``) names one
    job; see :func:`job_token` for the others."""
    job = os.environ.get("TORCHELASTIC_RUN_ID", "")
    return job in ("", "none") or os.environ.get(SHARED_RUN_ID) == job


def job_token(*, new: bool, timeout: float) -> str | None:
    """A random value that names this job and no other, the same in all its processes and restarts, even where
    its id (:func:`shared_run_id`) names other jobs too; None where the processes have no agent store.

    It is kept in the store of torchrun's agent (TORCHELASTIC_USE_AGENT_STORE, at MASTER_ADDR:MASTER_PORT),
    which the agent keeps across the restarts of its job and which ends with it: a later job has a store of its
    own, under the same id or not. ``new`` replaces the value with a fresh one: the first attempt's rank 0 does,
    before it records the value, so that a value left by an earlier job in a store that outlived it is never
    taken for this job's. Otherwise the value is read, or made where no attempt made one (all ranks get the
    same). No clock is read, so clocks that differ between nodes do not matter.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or "MASTER_ADDR" not in os.environ:
        return None
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    store = TCPStore(host, port, None, False, timedelta(seconds=timeout), wait_for_workers=False)
    fresh = uuid.uuid4().hex
    if new:
        store.set(JOB_TOKEN_KEY, fresh)
        return fresh
    return bytes(store.compare_set(JOB_TOKEN_KEY, "", fresh)).decode()


def _pass_on(signum: int, frame: FrameType | None) -> None:
    for child in multiprocessing.active_children():  # the agent's worker processes are this process's children
        with contextlib.suppress(ProcessLookupError):
            os.kill(child.pid, signum)  # type: ignore[arg-type]


@contextlib.contextmanager
def _passing_stop_signals(active: bool) -> Iterator[None]:
    """Within, SIGTERM and SIGINT to this process go on to its processes (see ``pass_stop_signals``)."""
    if not active or threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, _pass_on) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _checked(nprocs: int, options: LaunchOptions) -> None:
    """Refuse options :func:`launch` does not have, and values out of range, in one line each."""
    unknown = sorted(set(options) - set(LaunchOptions.__annotations__))
    if unknown:
        raise TypeError(
            f"launch got options it does not have: {', '.join(unknown)}; it takes "
            f"{', '.join(sorted(LaunchOptions.__annotations__))} (the function's own arguments go before them, by "
            "position)"
        )
    nnodes = options.get("nnodes", 1)
    max_restarts = options.get("max_restarts", 0)
    device = options.get("device", "cpu")
    start_method = options.get("start_method", "spawn")
    counts: list[tuple[str, object, int]] = [
        ("nprocs", nprocs, 1),
        ("nnodes", nnodes, 1),
        ("max_restarts", max_restarts, 0),
    ]
    if options.get("threads", 1) is not None:
        counts.append(("threads", options.get("threads", 1), 1))
    for name, value, least in counts:
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ValueError(f"{name} must be an int >= {least}, got {value!r}")
    if device not in ("cpu", "auto"):
        raise ValueError(f"device must be 'cpu' or 'auto', got {device!r}")
    if start_method not in get_args(StartMethod):
        raise ValueError(f"start_method must be one of {list(get_args(StartMethod))}, got {start_method!r}")
    if nnodes > 1 and "rdzv_endpoint" not in options:
        raise ValueError(
            f"nnodes={nnodes} needs rdzv_endpoint='HOST:PORT', the same on every node "
            "(the host of the node with is_host=True)"
        )


def _run(
    entrypoint: Callable[..., Any] | str, args: Sequence[Any], nprocs: int, options: LaunchOptions
) -> dict[int, Any]:
    _checked(nprocs, options)
    nnodes = options.get("nnodes", 1)
    start_method = options.get("start_method", "spawn")
    is_host = options.get("is_host")
    endpoint = options.get("rdzv_endpoint") or f"{LOOPBACK}:0"
    host = endpoint.rsplit(":", 1)[0]
    rdzv_configs: dict[str, Any] = {} if is_host is None else {"is_host": is_host}
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
    children = _children(options)
    if options.get("pin_cores") and isinstance(entrypoint, _Returning):
        entrypoint.cores = cpu_shares(nprocs)
    if start_method == "forkserver" and isinstance(entrypoint, _Returning):
        module = entrypoint.fn.__module__
        extra = [module] if module and module != "__main__" else []
        multiprocessing.set_forkserver_preload([*FORKSERVER_PRELOAD, *extra])  # used when the server starts
    with tempfile.TemporaryDirectory(prefix="stagewise-launch-") as logs:
        if isinstance(entrypoint, _Returning):  # where each process records its rank, for its peers to name it
            entrypoint.env[RANKS_DIR] = str(Path(logs, "ranks"))
            Path(logs, "ranks").mkdir()
        config = LaunchConfig(
            min_nodes=nnodes,
            max_nodes=nnodes,
            nproc_per_node=nprocs,
            run_id=options.get("run_id")
            or (_endpoint_run_id(endpoint) if nnodes > 1 else f"stagewise-{uuid.uuid4().hex[:12]}"),
            rdzv_backend=backend,
            rdzv_endpoint=endpoint,
            rdzv_configs=rdzv_configs,
            max_restarts=options.get("max_restarts", 0),
            monitor_interval=options.get("monitor_interval", 0.1),
            start_method=start_method,
            signals_to_handle="SIGHUP,SIGQUIT" if options.get("pass_stop_signals") else "SIGTERM,SIGINT,SIGHUP,SIGQUIT",
            local_addr=host if host in (LOOPBACK, "localhost") else None,
            logs_specs=DefaultLogsSpecs(log_dir=logs, tee=Std.ALL)
            if options.get("tee", True)
            else DefaultLogsSpecs(log_dir=logs, redirects=Std.NONE, tee=Std.NONE),
        )
        try:
            with _environment(children), _passing_stop_signals(options.get("pass_stop_signals", False)):
                result = elastic_launch(config, entrypoint)(*args)
        except ChildFailedError as err:
            raise LaunchError(failures_of(err, Path(logs), options.get("layout"))) from None
    return dict(result or {})
