"""The rendezvous of a one-node job: a store that the launcher owns, listening on a loopback socket it bound itself.

torch's c10d rendezvous suits several nodes, but on one node it is the wrong
tool: its store listens on every interface, the state it keeps there is a
pickle that the agent unpickles, and the port it is given is free only until
someone else takes it first. :class:`LoopbackRendezvous` binds its socket
itself, on 127.0.0.1 (or the loopback address asked for), and hands that very
socket to a :class:`~torch.distributed.TCPStore` (``master_listen_fd``): there
is no moment at which the port is free, nothing listens beyond loopback, and
the agent reads only plain keys from the store (no rendezvous state, nothing
unpickled). The launched processes join the same store as torchrun's agent
store (``TORCHELASTIC_USE_AGENT_STORE``).
"""

from __future__ import annotations

import ipaddress
import logging
import socket
from datetime import timedelta

from torch.distributed import PrefixStore, Store, TCPStore  # type: ignore[attr-defined]  # public, not re-exported
from torch.distributed.elastic.rendezvous import (
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStoreInfo,
    rendezvous_handler_registry,
)

log = logging.getLogger(__name__)

BACKEND = "stagewise-loopback"
"""The name under which :class:`LoopbackRendezvous` is registered with torch's rendezvous handlers."""

STORE_TIMEOUT = 600.0
"""Seconds a request to the store waits for a key (torch's agent waits on keys while its processes start)."""


def is_loopback(host: str) -> bool:
    """Whether ``host`` names this machine's loopback interface alone ("localhost", 127.0.0.0/8, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def bound_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host``:``port`` (0: any free port), bound now: nobody can take its port."""
    family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
    address = "localhost" if host == "localhost" else host.strip("[]")
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.bind((socket.gethostbyname(address) if family == socket.AF_INET else address, port))
        sock.listen(socket.SOMAXCONN)
    except OSError as err:
        sock.close()
        raise ValueError(
            f"cannot listen on {host}:{port} for the rendezvous ({err.strerror}); choose another port, or leave "
            "rdzv_endpoint out for a free one"
        ) from err
    return sock


class LoopbackRendezvous(RendezvousHandler):
    """One node's rendezvous: the node is group rank 0 of 1, its store the launcher's own on loopback.

    The store is made when the handler is (before any process starts) and
    kept across the agent's restarts of its processes; :meth:`shutdown`, which
    the agent calls when the job ends, closes it.
    """

    def __init__(self, run_id: str, host: str, port: int, timeout: float = STORE_TIMEOUT) -> None:
        if not is_loopback(host):
            raise ValueError(
                f"the one-node rendezvous listens on loopback alone, but the endpoint's host is {host!r}; give "
                "127.0.0.1 (or leave rdzv_endpoint out), or launch with nnodes > 1 for several machines"
            )
        sock = bound_socket(host, port)
        self.host, self.port = sock.getsockname()[:2]
        self.run_id = run_id
        fd = sock.detach()  # the store owns the socket from here on, and closes it
        self._server: TCPStore | None = TCPStore(
            self.host, self.port, None, True, timedelta(seconds=timeout), wait_for_workers=False, master_listen_fd=fd
        )
        self._closed = False
        log.debug("rendezvous store of job %s on %s:%d", run_id, self.host, self.port)

    @property
    def endpoint(self) -> str:
        """``HOST:PORT`` of the store."""
        return f"{self.host}:{self.port}"

    def get_backend(self) -> str:
        return BACKEND

    @property
    def use_agent_store(self) -> bool:
        return True

    def next_rendezvous(self) -> RendezvousInfo:
        if self._server is None:
            raise RuntimeError(f"the rendezvous of job {self.run_id} was shut down")
        store: Store = PrefixStore(self.run_id, self._server)
        return RendezvousInfo(store, 0, 1, RendezvousStoreInfo(self.host, self.port))

    def is_closed(self) -> bool:
        return self._closed

    def set_closed(self) -> None:
        self._closed = True

    def num_nodes_waiting(self) -> int:
        return 0

    def get_run_id(self) -> str:
        return self.run_id

    def shutdown(self) -> bool:
        self._server = None  # the last reference: the store stops listening
        return True


def _create(params: RendezvousParameters) -> RendezvousHandler:
    host, _, port = params.endpoint.rpartition(":")
    if params.max_nodes != 1:
        raise ValueError(f"the {BACKEND} rendezvous is for one node, not {params.max_nodes}; use c10d for several")
    timeout = params.get_as_int("store_timeout", int(STORE_TIMEOUT))
    return LoopbackRendezvous(params.run_id, host or "127.0.0.1", int(port or 0), float(timeout or STORE_TIMEOUT))


def register() -> None:
    """Register :class:`LoopbackRendezvous` with torch's rendezvous handlers as :data:`BACKEND` (once)."""
    rendezvous_handler_registry.register(BACKEND, _create)  # registering the same creator again changes nothing
