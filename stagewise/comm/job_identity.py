"""Who a launched job is: its restarts, whether its run id names it alone, and the token that always does."""

from __future__ import annotations

import os
import uuid
from datetime import timedelta

from torch.distributed import TCPStore  # type: ignore[attr-defined]  # public, not re-exported

SHARED_RUN_ID = "STAGEWISE_SHARED_RUN_ID"
"""Set by :func:`~stagewise.comm.launcher.launch` in its processes to the job's id when it made that id from the
rendezvous endpoint (several nodes and no ``run_id``): every job on that endpoint then has the same id (see
:func:`shared_run_id`)."""

JOB_TOKEN_KEY = "stagewise/job_token"
"""The key of :func:`job_token`'s value in the store of torchrun's agent."""


def endpoint_run_id(endpoint: str) -> str:
    """The job id of several nodes launched without ``run_id``: the same on each node, and for every job there."""
    return f"stagewise-{endpoint}"


def restarts() -> int:
    """How often torchrun's elastic agent has restarted this process's job after a failure (0 in the first
    attempt, and outside torchrun)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def shared_run_id() -> bool:
    """Whether this process's job id (TORCHELASTIC_RUN_ID) may name other jobs as well, so that it cannot tell
    them apart: empty, torchrun's "none" (its default without ``--rdzv-id``, on several nodes), or the id that
    :func:`~stagewise.comm.launcher.launch` made from the rendezvous endpoint (:data:`SHARED_RUN_ID`). A random
    id (what ``launch`` gives one node and ``torchrun --standalone`` any job) or one the user gave
    (``--rdzv-id``, ``run_id``) names one job; see :func:`job_token` for the others."""
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
