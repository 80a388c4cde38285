"""The one-node rendezvous: nothing listens beyond loopback, and nothing a peer writes into the store runs as code."""

from __future__ import annotations

import base64
import ipaddress
import os
import pickle
import socket
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist
from support.multiproc import run_ranks
from torch.distributed import TCPStore

from stagewise.comm.rendezvous import LoopbackRendezvous, bound_socket, is_loopback


def _listening_inodes() -> dict[int, tuple[str, int]]:
    """Each listening TCP socket of this machine: its inode -> (address, port), from /proc/net/tcp and tcp6."""
    found: dict[int, tuple[str, int]] = {}
    for table, width in (("/proc/net/tcp", 4), ("/proc/net/tcp6", 16)):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] != "0A":  # TCP_LISTEN
                continue
            address, port = fields[1].split(":")
            raw = bytes.fromhex(address)
            # /proc prints each 32-bit word of the address in host (little-endian) order.
            packed = b"".join(raw[i : i + 4][::-1] for i in range(0, width, 4))
            found[int(fields[9])] = (str(ipaddress.ip_address(packed)), int(port, 16))
    return found


def _sockets_of(pid: int) -> set[int]:
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            inodes.add(int(target[8:-1]))
    return inodes


def _job_pids() -> list[int]:
    """The launcher (this rank's parent, which runs torchrun's agent) and every process it started."""
    launcher = os.getppid()
    pids = [launcher]
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat[stat.rindex(")") + 2 :].split()[1]) == launcher:
                pids.append(int(entry.name))
    return pids


def job_listeners() -> list[tuple[str, int]]:
    """Every address and port the job's processes (launcher and ranks) listen on, once the group is up."""
    dist.init_process_group("gloo")
    dist.barrier()
    listening = _listening_inodes()
    mine = set().union(*(_sockets_of(pid) for pid in _job_pids()))
    dist.barrier()
    dist.destroy_process_group()
    return sorted(listening[inode] for inode in mine if inode in listening)


def test_a_one_node_job_listens_on_loopback_alone() -> None:
    results = run_ranks(job_listeners, 2)
    listeners = results[0]
    assert listeners, "the job's store and gloo listen somewhere"
    beyond = [(host, port) for host, port in listeners if not ipaddress.ip_address(host).is_loopback]
    assert beyond == [], f"listening beyond loopback: {beyond}"


class _Planted:
    """A pickle that makes a folder when it is loaded: proof that the loader ran code."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.mkdir, (self.path,))


def plant_rendezvous_state(marker: str) -> bool:
    """Overwrite the rendezvous state, as torch's c10d rendezvous keeps it, in every store the launcher serves."""
    dist.init_process_group("gloo")
    if dist.get_rank() == 0:
        payload = base64.b64encode(pickle.dumps(_Planted(marker)))
        key = f"torch.rendezvous.{os.environ['TORCHELASTIC_RUN_ID']}"
        listening = _listening_inodes()
        for inode in _sockets_of(os.getppid()):
            if inode in listening:
                host, port = listening[inode]
                client = TCPStore(host, port, None, False, timedelta(seconds=5), wait_for_workers=False)
                client.set(key, payload)
        time.sleep(1.5)  # the agent reads its rendezvous state every monitor interval (0.1 s) and on keep-alive
    dist.barrier()
    ran = os.path.exists(marker)
    dist.destroy_process_group()
    return ran


def test_a_rendezvous_state_planted_in_the_store_is_never_unpickled() -> None:
    with tempfile.TemporaryDirectory() as folder:
        marker = str(Path(folder) / "ran")
        results = run_ranks(plant_rendezvous_state, 2, marker)
        assert results == {0: False, 1: False}
        assert not Path(marker).exists()


def test_the_store_binds_its_own_socket_on_loopback() -> None:
    handler = LoopbackRendezvous("job", "127.0.0.1", 0)
    try:
        inodes = {port: inode for inode, (_, port) in _listening_inodes().items()}
        assert handler.port in inodes and _listening_inodes()[inodes[handler.port]][0] == "127.0.0.1"
        info = handler.next_rendezvous()
        info.store.set("k", "v")
        client = TCPStore("127.0.0.1", handler.port, None, False, timedelta(seconds=5), wait_for_workers=False)
        assert client.get("job/k") == b"v"  # the agent's keys are prefixed with the job's id
        # The port was never free: another listener cannot take it.
        with pytest.raises(ValueError, match=rf"cannot listen on 127.0.0.1:{handler.port} for the rendezvous"):
            bound_socket("127.0.0.1", handler.port)
    finally:
        handler.shutdown()
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        with pytest.raises(ValueError, match=rf"cannot listen on 127.0.0.1:{port} for the rendezvous"):
            LoopbackRendezvous("job", "127.0.0.1", port)


def test_a_one_node_rendezvous_refuses_an_address_beyond_loopback() -> None:
    assert is_loopback("127.0.0.1") and is_loopback("localhost") and is_loopback("::1")
    assert not is_loopback("0.0.0.0") and not is_loopback("192.0.2.7") and not is_loopback("node1")
    with pytest.raises(ValueError, match=r"listens on loopback alone, but the endpoint's host is '0.0.0.0'"):
        LoopbackRendezvous("job", "0.0.0.0", 0)
