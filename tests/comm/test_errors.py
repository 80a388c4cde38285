"""Which failures of a collective are about the other ranks, and so become named CommErrors."""

from __future__ import annotations

from stagewise.comm import CommTimeoutError, PeerGoneError
from stagewise.comm.errors import collective_failed, failed_between_ranks


def test_timeouts_and_lost_peers_are_between_ranks_and_misuse_is_not() -> None:
    timeout = RuntimeError("[../gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 3000ms for recv")
    lost = RuntimeError("[../gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:4242")
    misuse = RuntimeError("No backend type associated with device type cpu")
    assert failed_between_ranks(timeout) and failed_between_ranks(lost)
    assert not failed_between_ranks(misuse)  # stays as raised: naming a peer would mislead
    named = collective_failed(timeout, rank=0, peer=1, what="the all-reduce of the gradients' norm", timeout=3.0)
    assert isinstance(named, CommTimeoutError)
    assert str(named).startswith("rank 0 timed out after 3 s in the all-reduce of the gradients' norm (")
    gone = collective_failed(lost, rank=0, peer=1, what="DDP's all-reduce", timeout=None)
    assert isinstance(gone, PeerGoneError) and str(gone).startswith("rank 0 lost a peer during DDP's all-reduce")
