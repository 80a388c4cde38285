"""How a launch starts its processes: the options, their checks, and the environment the processes get."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal, TypedDict, get_args

from stagewise.comm.job_identity import SHARED_RUN_ID, endpoint_run_id
from stagewise.comm.layout import Layout
from stagewise.errors import is_whole, whole_number

StartMethod = Literal["spawn", "forkserver", "fork"]
"""How :func:`~stagewise.comm.launcher.launch` starts its processes; see :attr:`LaunchOptions.start_method`."""


class LaunchOptions(TypedDict, total=False):
    """How :func:`~stagewise.comm.launcher.launch` and :func:`~stagewise.comm.launcher.launch_module` start the
    processes; every key is optional."""

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
    makes the same: then every job on that endpoint has the same id (see
    :func:`~stagewise.comm.job_identity.shared_run_id`). Give each job its own (a scheduler's job id) to let a
    restart trust the id alone."""
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
    """How :func:`~stagewise.comm.launcher.launch` starts the processes. "spawn" (default): each is a fresh
    interpreter that imports torch itself. "forkserver": each is forked from multiprocessing's fork server, which
    imports torch, stagewise and the function's module once per launching process
    (:data:`~stagewise.comm.launcher.FORKSERVER_PRELOAD`), so a process that launches many short jobs starts each
    in a fraction of the time; ``env`` and ``threads`` are then applied in each process before the function runs.
    "fork": each is a copy of the launching process, started at once with whatever it has imported (torchrun's
    ``--start-method fork``); only from a process that has started no CUDA context and runs no other threads of
    its own, as a copy keeps none of them. :func:`~stagewise.comm.launcher.launch_module` always starts fresh
    interpreters."""
    layout: Layout
    """The job's ``pp x dp`` layout, so that a failure names the rank's stage and replica."""
    tee: bool
    """Copy each process's output to ours with a ``[rank]`` prefix (default); False lets them write to our
    terminal directly, as a progress bar needs."""
    pin_cores: bool
    """Give each process of :func:`~stagewise.comm.launcher.launch` its own equal share of the CPUs this process
    may run on (Linux ``sched_setaffinity``), set before ``fn`` runs so the threads it starts (gloo's among them)
    stay there (default False: the OS places them). On a machine whose cores the ranks fill, this keeps gloo's
    threads from waiting behind another rank's compute."""
    pass_stop_signals: bool
    """Pass SIGTERM and SIGINT on to the processes and let them end as they choose (default False: torch's agent
    stops them at once on either). A process that handles them (``stagewise.run.StopSignals``) can finish its step
    and save; its result comes back as usual."""


_COUNT_FIXES = {
    "nprocs": "launch at least one process",
    "nnodes": "give 1 for one node",
    "max_restarts": "give 0 for no restart",
    "threads": "give at least 1, or None to leave OMP_NUM_THREADS alone",
}
"""How to mend each count :func:`checked_options` refuses."""


def checked_options(nprocs: int, options: LaunchOptions) -> None:
    """Refuse options a launch does not have, and values out of range, in one line each."""
    unknown = sorted(set(options) - set(LaunchOptions.__annotations__))
    if unknown:
        raise TypeError(
            f"launch got options it does not have: {', '.join(unknown)}; it takes "
            f"{', '.join(sorted(LaunchOptions.__annotations__))} (the function's own arguments go before them, by "
            "position)"
        )
    nnodes = options.get("nnodes", 1)
    device = options.get("device", "cpu")
    start_method = options.get("start_method", "spawn")
    counts: list[tuple[str, object, int]] = [
        ("nprocs", nprocs, 1),
        ("nnodes", nnodes, 1),
        ("max_restarts", options.get("max_restarts", 0), 0),
    ]
    if options.get("threads", 1) is not None:
        counts.append(("threads", options.get("threads", 1), 1))
    for name, value, least in counts:
        whole_number(name, value, least=least, fix=_COUNT_FIXES[name])
    if device not in ("cpu", "auto"):
        raise ValueError(f"device must be 'cpu' or 'auto', got {device!r}")
    if start_method not in get_args(StartMethod):
        raise ValueError(f"start_method must be one of {list(get_args(StartMethod))}, got {start_method!r}")
    if nnodes > 1 and "rdzv_endpoint" not in options:
        raise ValueError(
            f"nnodes={nnodes} needs rdzv_endpoint='HOST:PORT', the same on every node "
            "(the host of the node with is_host=True)"
        )


def child_environment(options: LaunchOptions) -> dict[str, str]:
    """The environment variables the launched processes get on top of ours."""
    children: dict[str, str] = dict(options.get("env", {}))
    if options.get("device", "cpu") == "cpu":
        children["CUDA_VISIBLE_DEVICES"] = ""
    threads = options.get("threads", 1)
    if threads is not None:
        children["OMP_NUM_THREADS"] = str(threads)
    nnodes, endpoint = options.get("nnodes", 1), options.get("rdzv_endpoint")
    if not options.get("run_id") and is_whole(nnodes) and nnodes > 1 and endpoint:
        children[SHARED_RUN_ID] = endpoint_run_id(endpoint)
    return children
