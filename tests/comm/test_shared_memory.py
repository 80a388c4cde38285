"""The shared-memory wire: gloo's matching by (peer, tag), exact bytes, reused segments, no leftovers, no hangs."""

from __future__ import annotations

import atexit
import errno
import fcntl
import logging
import os
import secrets
import signal
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from support.multiproc import run_ranks

from stagewise.comm import (
    CommTimeoutError,
    LaunchError,
    PeerGoneError,
    Transport,
    init_mesh,
    shared_memory_connect,
    shared_memory_files,
    shared_memory_segments,
)
from stagewise.comm.shared_memory import SharedMemoryWire
from stagewise.comm.shared_memory_connect import connect_shared_memory

SIZES = [1, 3, 17, 4096, 4097, 70_000, 5 * 2**20 // 4]  # float32 elements: below, at and above segment sizes


def _message(tag: int, i: int) -> torch.Tensor:
    n = SIZES[(tag + i) % len(SIZES)]
    g = torch.Generator().manual_seed(1000 * tag + i)
    return torch.randint(-(2**31), 2**31 - 1, (n,), generator=g, dtype=torch.int32).view(torch.float32)  # any bits


def matching() -> dict[str, object]:
    """Rank 0 sends 3 tags interleaved; rank 1 posts them per tag in another order, some after they landed."""
    init_mesh(2, timeout=30)
    group = dist.new_group([0, 1], backend="gloo")
    wire = connect_shared_memory(group, dist.get_rank())
    assert wire is not None
    rounds, tags = 6, (0, 1, 2)
    if dist.get_rank() == 0:
        sent = [wire.isend(_message(tag, i), 1, tag) for i in range(rounds) for tag in tags]
        for work in sent:
            assert work.wait()
        dist.barrier(group)
        # Sends waited for: their segments came back, so a second round of the same sizes makes none.
        made = wire.segments
        again = [wire.isend(_message(tag, i), 1, tag) for i in range(rounds) for tag in tags]
        for work in again:
            assert work.wait()
        files = sorted(p.name for p in wire.folder.parent.glob(f"{wire.folder.name}*"))
        wire.close()
        return {"segments": made, "after": wire.segments, "files": files}
    time.sleep(0.3)  # the first messages land before any receive is posted
    got: dict[tuple[int, int], torch.Tensor] = {}
    posted = []
    for tag in (2, 0, 1):  # tag by tag: the others' messages wait in copies of their own
        for i in range(rounds):
            buffer = torch.empty_like(_message(tag, i))
            posted.append((tag, i, buffer, wire.irecv(buffer, 0, tag)))
    for tag, i, buffer, work in posted:
        assert work.wait()
        got[(tag, i)] = buffer
    dist.barrier(group)
    for i in range(rounds):
        for tag in tags:
            buffer = torch.empty_like(_message(tag, i))
            assert wire.irecv(buffer, 0, tag).wait()
            assert torch.equal(buffer.view(torch.int32), _message(tag, i).view(torch.int32))
    exact = all(torch.equal(b.view(torch.int32), _message(t, i).view(torch.int32)) for (t, i), b in got.items())
    wire.close()
    return {"exact": exact, "received": len(got)}


def test_messages_match_receives_per_tag_in_order_and_segments_are_reused() -> None:
    out = run_ranks(matching, 2)
    assert out[1] == {"exact": True, "received": 18}
    sender = out[0]
    assert sender["after"] == sender["segments"]  # nothing new for the second round
    assert sender["segments"] <= 18
    # The folder goes once connected, and the receiver unlinks each segment once it has mapped it: a rank that
    # dies leaves nothing behind but what no peer received.
    assert sender["files"] == []


def alternating() -> bool:
    """Rank 1 sends messages of one size to ranks 0 and 2 by turns, each received before the next is sent."""
    init_mesh(3, timeout=30)
    group = dist.new_group([0, 1, 2], backend="gloo")
    wire = connect_shared_memory(group, dist.get_rank())
    assert wire is not None
    ok = True
    for i in range(6):
        peer = 2 * (i % 2)
        if dist.get_rank() == 1:
            assert wire.isend(torch.full((64,), float(i)), peer, 0).wait()
        elif dist.get_rank() == peer:
            buffer = torch.empty(64)
            assert wire.irecv(buffer, 1, 0).wait()
            ok = ok and bool((buffer == i).all())
        dist.barrier(group)
    wire.close()
    return ok


def test_a_segment_freed_by_one_peer_is_not_sent_to_another() -> None:
    # Each receiver maps (and unlinks) only the segments sent to it: one reused for another peer would be gone there.
    assert run_ranks(alternating, 3) == {0: True, 1: True, 2: True}


def transport_round_trip(shared_memory: bool | None, hide: bool) -> tuple[bool, bool]:
    """An echo through a dedicated Transport; ``hide`` makes rank 1 unable to read rank 0's folder."""
    if hide and int(os.environ["RANK"]) == 1:
        shared_memory_connect._reads = lambda path, token: False  # type: ignore[assignment]
    init_mesh(2, timeout=30)
    transport = Transport(timeout=30, dedicated=True, shared_memory=shared_memory)
    x = torch.arange(12.0).reshape(3, 4).requires_grad_()
    if dist.get_rank() == 0:
        transport.send(x, 1, what="x")
        back = transport.recv(1, what="back")
    else:
        back = transport.recv(0, what="x")
        transport.send(back, 0, what="back")
    transport.wait_sends()
    used = isinstance(transport.wire, SharedMemoryWire)
    transport.close()
    return used, bool(torch.equal(back, x.detach())) and back.requires_grad


CASES = [(None, False, True), (None, True, False)]  # False keeps gloo: the "gloo" cases of test_p2p.py


@pytest.mark.parametrize(("shared_memory", "hide", "used"), CASES)
def test_a_dedicated_transport_uses_shared_memory_only_where_every_rank_reaches_it(
    shared_memory: bool | None, hide: bool, used: bool
) -> None:
    assert run_ranks(transport_round_trip, 2, shared_memory, hide) == {0: (used, True), 1: (used, True)}


def insisting() -> tuple[str, str]:
    if int(os.environ["RANK"]) == 1:
        shared_memory_connect._reads = lambda path, token: False  # type: ignore[assignment]
    init_mesh(2, timeout=30)
    messages = []
    for dedicated in (False, True):
        try:
            Transport(timeout=30, dedicated=dedicated, shared_memory=True)
            messages.append("no error")
        except (RuntimeError, ValueError) as err:
            messages.append(f"{type(err).__name__}: {err}")
    return messages[0], messages[1]


def test_insisting_on_shared_memory_where_it_cannot_be_says_why() -> None:
    refused, unshared = run_ranks(insisting, 2)[0]
    assert refused.startswith("ValueError: shared_memory=True needs a dedicated transport on the CPU"), refused
    assert unshared.startswith(
        "RuntimeError: rank 0: shared_memory=True, but not every rank of the transport can reach"
    ), unshared


def stall_then_die(report: str) -> None:
    init_mesh(2, timeout=60)
    transport = Transport(timeout=1.0, dedicated=True)
    assert isinstance(transport.wire, SharedMemoryWire)
    dist.barrier()
    if dist.get_rank() == 1:
        if os.fork() == 0:  # a data loader's worker, say: it inherits the pipes and must not keep them open
            time.sleep(6)
            os._exit(0)
        time.sleep(2.0)  # alive past rank 0's timeout, then gone
        os.kill(os.getpid(), signal.SIGKILL)
    lines = []
    start = time.perf_counter()
    try:
        transport.recv(1, what="the activation of micro-batch 3")
    except CommTimeoutError as err:
        lines.append(f"{err} [after {time.perf_counter() - start:.1f} s]")
    transport.timeout = transport.timeout * 20
    time.sleep(1.5)
    start = time.perf_counter()
    try:
        transport.recv(1, what="the gradient of micro-batch 0")
    except PeerGoneError as err:
        lines.append(f"{err} [after {time.perf_counter() - start:.1f} s]")
        raise
    finally:
        Path(report).write_text("\n".join(lines))  # before raising: the agent may stop this rank first


def test_over_shared_memory_a_stalled_peer_times_out_and_a_killed_one_is_named(tmp_path: Path) -> None:
    report = tmp_path / "survivor.txt"
    with pytest.raises(LaunchError):
        run_ranks(stall_then_die, 2, str(report), monitor_interval=5.0, timeout=90)
    stalled, killed = report.read_text().splitlines()
    assert stalled.startswith(
        "rank 0 timed out after 1 s waiting for the activation of micro-batch 3 (control word) from rank 1"
    ), stalled
    assert killed.startswith("rank 0 lost rank 1 while waiting for the gradient of micro-batch 0"), killed
    assert float(killed.rsplit("[after ", 1)[1].split(" s]")[0]) < 1.0  # at once, not after the 20 s timeout


def no_room() -> str:
    init_mesh(2, timeout=30)
    transport = Transport(timeout=30, dedicated=True)
    message = "no error"
    if dist.get_rank() == 0:

        def full(fd: int, offset: int, length: int) -> None:
            raise OSError(errno.ENOSPC, "No space left on device")

        os.posix_fallocate = full
        try:
            transport.send(torch.zeros(2**18), 1, what="x")
        except RuntimeError as err:
            message = str(err)
    transport.close()
    return message


def test_shared_memory_that_runs_out_is_an_error_that_names_the_fixes() -> None:
    message = run_ranks(no_room, 2)[0]
    # The first segment it needs is the control word's, of the smallest size.
    assert message.startswith("rank 0 cannot reserve 4.0 KiB of shared memory in /dev/shm ("), message
    assert "No space left on device); give the host more shared memory (docker: --shm-size)" in message
    assert message.endswith("set STAGEWISE_SHARED_MEMORY=0 (Transport: shared_memory=False)")


def unreceived() -> str:
    """Rank 0 sends a message rank 1 never receives; both leave normally, without closing their transports."""
    init_mesh(2, timeout=30)
    transport = Transport(timeout=30, dedicated=True)
    assert isinstance(transport.wire, SharedMemoryWire)
    if dist.get_rank() == 0:
        transport.send(torch.zeros(1000), 1, what="x")
    dist.barrier()
    return str(transport.wire.folder)


def test_segments_no_peer_received_are_removed_when_their_process_exits() -> None:
    folder = Path(run_ranks(unreceived, 2)[0])
    assert not folder.exists()
    assert list(folder.parent.glob(f"{folder.name}*")) == []


def child_exits() -> bool:
    """Rank 0 sends, then forks a child that exits normally (its exit functions run) before rank 1 receives."""
    init_mesh(2, timeout=30)
    transport = Transport(timeout=30, dedicated=True)
    x = torch.arange(6.0)
    if dist.get_rank() == 0:
        transport.send(x, 1, what="x")
        child = os.fork()
        if child == 0:  # a worker of the rank's own that ends normally
            atexit._run_exitfuncs()
            os._exit(0)
        os.waitpid(child, 0)
    dist.barrier()
    ok = True if dist.get_rank() == 0 else bool(torch.equal(transport.recv(0, what="x"), x))
    transport.wait_sends()
    return ok


def test_a_forked_child_that_exits_leaves_its_parents_segments_alone() -> None:
    assert run_ranks(child_exits, 2) == {0: True, 1: True}


def _wires_in(base: str) -> None:
    """Keep this process's wire files in ``base``, not /dev/shm: there, the start of any other job on the machine
    (a test in the suite's other worker) removes a killed process's files too, perhaps before the test looks."""
    shared_memory_files.shared_base = lambda: Path(base)  # type: ignore[method-assign]


def killed_with_a_segment_left(report: str, base: str) -> None:
    """Rank 0 sends a message rank 1 never receives; then both are killed, so no exit function of theirs runs."""
    # The first rank killed makes the launcher stop the other with SIGTERM, whose exit would run the exit functions
    # (removing the segment) if it came before that rank's own SIGKILL: blocked, it never comes first.
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
    _wires_in(base)
    init_mesh(2, timeout=30)
    transport = Transport(timeout=30, dedicated=True)
    assert isinstance(transport.wire, SharedMemoryWire)
    if dist.get_rank() == 0:
        transport.send(torch.zeros(1000), 1, what="x")
        Path(report).write_text(str(transport.wire.folder))
    dist.barrier()
    os.kill(os.getpid(), signal.SIGKILL)


def a_later_start(base: str) -> bool:
    """A new job's transport: its wire's start removes what processes that are gone left."""
    _wires_in(base)
    init_mesh(2, timeout=30)
    transport = Transport(timeout=30, dedicated=True)
    used = isinstance(transport.wire, SharedMemoryWire)
    transport.close()
    return used


def test_what_a_killed_process_left_in_shared_memory_goes_at_the_next_start(tmp_path: Path) -> None:
    report, base = tmp_path / "folder.txt", tmp_path / "shm"
    base.mkdir()
    with pytest.raises(LaunchError):
        run_ranks(killed_with_a_segment_left, 2, str(report), str(base), timeout=60)
    folder = Path(report.read_text())
    assert folder.parent == base
    left = sorted(folder.parent.glob(f"{folder.name}*"))
    assert left, "SIGKILL runs no exit function: the unreceived segment is still there"
    assert run_ranks(a_later_start, 2, str(base)) == {0: True, 1: True}
    assert [path.name for path in left if path.exists()] == []


# A hostile or messy /dev/shm: wires of this one process (ranks 0 and 1, connected by two threads), files in tmp_path.


def _pair(base: Path) -> tuple[SharedMemoryWire, SharedMemoryWire]:
    folders = {rank: base / f"rank-{rank}" for rank in (0, 1)}
    for folder in folders.values():
        folder.mkdir(mode=0o700)
    wires = [SharedMemoryWire(rank, [1 - rank], folders) for rank in (0, 1)]
    barrier = threading.Barrier(2, timeout=10)
    threads = [threading.Thread(target=wire.connect, args=(barrier.wait,)) for wire in wires]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    return wires[0], wires[1]


def _echo(sender: SharedMemoryWire, receiver: SharedMemoryWire, x: torch.Tensor) -> torch.Tensor:
    sent = sender.isend(x, 1, 0)
    buffer = torch.empty_like(x)
    assert receiver.irecv(buffer, 0, 0).wait(5)
    assert sent.wait(5)
    return buffer


def test_a_file_planted_at_the_next_segments_name_does_not_stop_the_wire(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    sender, receiver = _pair(tmp_path)
    planted = shared_memory_files.segment_path(sender.folder, 0)  # the first name of sequential numbers
    planted.write_text("someone else's")
    draws = iter([0])  # random numbers: the first drawn is the planted one
    monkeypatch.setattr(
        shared_memory_segments, "_segment_number", lambda: next(draws, secrets.randbits(62)), raising=False
    )
    x = torch.arange(10.0)
    with caplog.at_level(logging.WARNING, logger=shared_memory_segments.__name__):
        assert torch.equal(_echo(sender, receiver, x), x)
    assert f"{planted} exists, made by someone else; trying another name" in caplog.text
    assert planted.read_text() == "someone else's"
    assert sender.segments == 1
    sender.close()
    receiver.close()


def test_a_segment_name_taken_every_time_is_a_one_line_error_naming_the_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sender, receiver = _pair(tmp_path)
    planted = shared_memory_files.segment_path(sender.folder, 0)
    planted.write_text("someone else's")
    monkeypatch.setattr(shared_memory_segments, "_segment_number", lambda: 0, raising=False)
    with pytest.raises(RuntimeError) as info:
        sender.isend(torch.zeros(4), 1, 0)
    message = str(info.value)
    assert message.startswith("rank 0 cannot create a shared-memory segment: 8 random names in a row were taken, ")
    assert f"the last {planted}; " in message and "\n" not in message
    sender.close()
    receiver.close()


def test_an_entry_the_orphan_scan_cannot_remove_is_skipped_and_the_scan_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    namespace, pid, start = shared_memory_files._me()
    dead = f"stagewise-{namespace}-{pid}-{start + 1}"  # this pid, another start: a process that is gone
    names = [f"{dead}-abc{i}-segment-{i}" for i in range(3)] + [f"{dead}-folder"]
    for name in names[:3]:
        (tmp_path / name).write_bytes(b"left")
    (tmp_path / names[3]).mkdir()
    (tmp_path / names[3] / "token").write_text("left")
    unlink, refused = os.unlink, []

    def unlink_refusing_one(path: str, *args: object, **kwargs: object) -> None:
        if not refused:  # the first entry the scan removes (whichever scandir yields first)
            refused.append(path)
            raise PermissionError(errno.EACCES, "Permission denied", path)
        unlink(path, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "unlink", unlink_refusing_one)
    with caplog.at_level(logging.WARNING, logger=shared_memory_files.__name__):
        removed = shared_memory_files.remove_orphans(tmp_path)
    monkeypatch.undo()
    left = [name for name in names if (tmp_path / name).exists()]
    assert len(left) == 1 and len(removed) == 3 and sorted([*removed, *left]) == sorted(names), (left, removed)
    assert f"cannot remove {tmp_path / left[0]}, left by a process that is gone; skipping it" in caplog.text


@pytest.mark.timeout(15)
def test_a_send_to_a_peer_whose_pipe_stays_full_times_out_and_the_wire_goes_on(tmp_path: Path) -> None:
    sender, receiver = _pair(tmp_path)
    sender.timeout = 0.5
    fd = sender.pipes.out[1]
    fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, 4096)  # the smallest pipe: a page of records
    records = fcntl.fcntl(fd, fcntl.F_GETPIPE_SZ) // 32
    for i in range(records):  # the receiver reads none of them
        sender.isend(torch.full((1,), float(i)), 1, 0)
    start = time.monotonic()
    with pytest.raises(CommTimeoutError) as info:
        sender.isend(torch.full((1,), float(records)), 1, 0)
    assert 0.5 <= time.monotonic() - start < 3.0
    assert str(info.value).startswith(
        "rank 0 timed out after 0.5 s waiting for room in rank 1's shared-memory pipe (full: rank 1 read nothing"
    ), info.value
    assert (info.value.rank, info.value.peer) == (0, 1)
    # The message that timed out was never announced: once the peer reads, the wire goes on in order.
    buffers = [torch.empty(1) for _ in range(records + 1)]
    works = [receiver.irecv(buffer, 0, 0) for buffer in buffers[:records]]
    assert all(work.wait(5) for work in works)
    assert torch.equal(_echo(sender, receiver, torch.full((1,), -1.0)), torch.full((1,), -1.0))
    assert [float(b) for b in buffers[:records]] == [float(i) for i in range(records)]
    sender.close()
    receiver.close()
