"""Point-to-point transfer between two gloo processes: exact round trips, changing shapes, no hangs."""

from __future__ import annotations

import functools
import os
import signal
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.multiproc import run_ranks

from stagewise.comm import CommTimeoutError, LaunchError, PeerGoneError, Transport, init_mesh
from stagewise.comm.meta import DTYPES, TensorMeta, decode, encode
from stagewise.comm.payload import as_tensors

DTYPE_CHOICES = [torch.float32, torch.bfloat16, torch.int64, torch.bool]


@st.composite
def tensors(draw: st.DrawFn) -> torch.Tensor:
    dtype = draw(st.sampled_from(DTYPE_CHOICES))
    shape = tuple(draw(st.lists(st.integers(0, 5), min_size=0, max_size=4)))
    n = 1
    for d in shape:
        n *= d
    # Arbitrary bytes: every bit pattern, NaNs and infinities included, must arrive as sent.
    raw = draw(st.binary(min_size=n * torch.empty((), dtype=dtype).element_size(), max_size=n * 8))
    size = n * torch.empty((), dtype=dtype).element_size()
    data = torch.frombuffer(bytearray(raw[:size]) or bytearray(1), dtype=torch.uint8)[:size]
    if dtype is torch.bool:
        data = data % 2
    tensor = data.view(dtype).reshape(shape).clone()
    if tensor.is_floating_point() and draw(st.booleans()):
        tensor.requires_grad_(True)
    return tensor


payloads = st.one_of(tensors(), st.lists(tensors(), min_size=1, max_size=4).map(tuple))


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.detach().reshape(-1).view(torch.uint8), b.detach().reshape(-1).view(torch.uint8))


def echo(
    messages: list[object], delay: float = 0.0, dedicated: bool | str = False, pace: float = 0.0
) -> list[tuple[object, list[bool]]]:
    """Rank 0 sends every message to rank 1 (``pace`` seconds apart), which receives them in order (after ``delay``)."""
    init_mesh(2, timeout=30)
    # "gloo": dedicated, with the messages on its own gloo group rather than shared memory (ranks on other hosts)
    transport = Transport(timeout=30, dedicated=bool(dedicated), shared_memory=False if dedicated == "gloo" else None)
    received = []
    if dist.get_rank() == 1:
        time.sleep(delay)
    for i, message in enumerate(messages):
        if dist.get_rank() == 0:
            time.sleep(pace)
            transport.send(message, 1, what=f"message {i}")  # type: ignore[arg-type]
        else:
            got = transport.recv(0, what=f"message {i}")
            tensors_, _ = as_tensors(got)
            received.append((got, [t.requires_grad for t in tensors_]))
    transport.wait_sends()
    dist.barrier()
    dist.destroy_process_group()
    return received


@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(st.lists(payloads, min_size=8, max_size=16), st.booleans())
def test_round_trips_are_bit_identical(messages: list[object], dedicated: bool) -> None:
    received = run_ranks(echo, 2, messages, 0.0, dedicated)[1]
    assert len(received) == len(messages)
    for sent, (got, grads) in zip(messages, received, strict=True):
        sent_tensors, sent_tuple = as_tensors(sent)
        got_tensors, got_tuple = as_tensors(got)
        assert sent_tuple == got_tuple
        assert all(same_bits(a, b) for a, b in zip(sent_tensors, got_tensors, strict=True))
        # Gradients travel only where they can: floating tensors that required grad.
        assert grads == [t.requires_grad for t in sent_tensors]
        assert not any(g for t, g in zip(got_tensors, grads, strict=True) if not t.is_floating_point())


def test_changing_shapes_and_integer_tensors() -> None:
    ids = torch.arange(12).reshape(2, 6)
    hidden = torch.randn(2, 6, 8, requires_grad=True)
    messages: list[object] = [
        (hidden, ids, ids > 3),
        (hidden, ids, ids > 3),  # same layout: no metadata resent
        (torch.randn(2, 9, 8, requires_grad=True), torch.arange(18).reshape(2, 9), torch.ones(2, 9, dtype=torch.bool)),
        torch.randn(3),
    ]
    received = run_ranks(echo, 2, messages)[1]
    for sent, (got, _) in zip(messages, received, strict=True):
        for a, b in zip(as_tensors(sent)[0], as_tensors(got)[0], strict=True):
            assert same_bits(a, b)
    assert received[2][1] == [True, False, False]


@pytest.mark.parametrize("dedicated", [False, True, "gloo"])
def test_steady_streams_that_change_layout(dedicated: bool | str) -> None:
    # Runs of equal layouts make the stream steady; each change after a run needs a stand-in message.
    a, b, c = torch.randn(4, 3), torch.randn(2, 5, requires_grad=True), (torch.arange(3), torch.randn(3))
    messages: list[object] = [a, a * 2, a * 3, b, b * 2, b * 3, a, c, c, c, b]
    received = run_ranks(echo, 2, messages, 0.0, dedicated)[1]
    for sent, (got, _) in zip(messages, received, strict=True):
        for x, y in zip(as_tensors(sent)[0], as_tensors(got)[0], strict=True):
            assert same_bits(x, y)


@pytest.mark.parametrize("dedicated", [False, True])
def test_a_stream_of_empty_payloads_that_changes_layout(dedicated: bool | str) -> None:
    # Empty payloads carry no data, so nothing but a control word can tell the receiver, which here waits
    # ahead of the sender, that the layout has changed: such a stream must never drop its control words.
    e, f = torch.zeros(0), (torch.zeros(0, 3), torch.zeros(2, 0))
    messages: list[object] = [e, e, e, e, torch.arange(5.0), torch.arange(5.0) + 1, f, f, f, torch.ones(2)]
    received = run_ranks(echo, 2, messages, 0.0, dedicated, 0.05)[1]
    assert len(received) == len(messages)
    for sent, (got, _) in zip(messages, received, strict=True):
        assert as_tensors(sent)[1] == as_tensors(got)[1]
        for x, y in zip(as_tensors(sent)[0], as_tensors(got)[0], strict=True):
            assert same_bits(x, y)


@pytest.mark.parametrize("dedicated", [False, True, "gloo"])
def test_a_change_announced_while_the_receiver_is_behind(dedicated: bool | str) -> None:
    # The sender runs ahead and has posted everything, the change of layout at message 5 with its stand-in,
    # before the late receiver reads the steady messages before it; they must come through as data. (With a
    # dedicated group, the change's control word lands in the receive left posted while the receiver is
    # still at message 3 or 4.)
    a, b = torch.randn(64, 3), torch.randn(5, 2)
    messages: list[object] = [a, a + 1, a + 2, a + 3, a + 4, b, b + 1, b + 2, a]
    received = run_ranks(echo, 2, messages, 1.0, dedicated)[1]
    for sent, (got, _) in zip(messages, received, strict=True):
        for x, y in zip(as_tensors(sent)[0], as_tensors(got)[0], strict=True):
            assert same_bits(x, y)


def neighbours_on_the_same_ranks() -> list[float]:
    """Two dedicated transports with steady streams, and raw sends on tag 0, between the same two ranks."""
    init_mesh(2, timeout=30)
    first, second = Transport(timeout=30, dedicated=True), Transport(timeout=30, dedicated=True)
    got: list[float] = []
    for step in range(4):
        for transport, value in ((first, 1.0), (second, 2.0)):
            if dist.get_rank() == 0:
                transport.send(torch.full((3,), value + step), 1, what="x")
                transport.wait_sends()
            else:
                got.append(float(transport.recv(0, what="x")[0]))  # type: ignore[index]
        raw = torch.full((3,), 10.0 + step)
        if dist.get_rank() == 0:
            dist.send(raw, 1)  # tag 0, on the default group: no standing receive may take it
        else:
            dist.recv(raw, 0)
            got.append(float(raw[0]))
    if dist.get_rank() == 0:  # a change of layout after all that: its control word lands where it should
        first.send(torch.zeros(7), 1, what="change")
        first.wait_sends()
    else:
        changed = first.recv(0, what="change")
        assert isinstance(changed, torch.Tensor)
        got.append(float(changed.numel()))
    dist.barrier()
    dist.destroy_process_group()
    return got


def test_dedicated_transports_take_no_one_elses_messages() -> None:
    got = run_ranks(neighbours_on_the_same_ranks, 2)[1]
    assert got == [1.0, 2.0, 10.0, 2.0, 3.0, 11.0, 3.0, 4.0, 12.0, 4.0, 5.0, 13.0, 7.0]


def varying_shapes() -> int:
    """Rank 0 sends 40 payloads of growing length, waiting for each; rank 1 releases each after use."""
    init_mesh(2, timeout=30)
    transport = Transport(timeout=30, dedicated=True)
    for n in range(1, 41):
        if dist.get_rank() == 0:
            transport.send(torch.ones(n, 4), 1, what=f"length {n}").wait()
        else:
            transport.release(transport.recv(0, what=f"length {n}"))
    left = len(transport._sends) if dist.get_rank() == 0 else len(transport._pool)
    dist.barrier()
    dist.destroy_process_group()
    return left


def test_waited_sends_and_old_shapes_are_let_go() -> None:
    # A sender that waits for each send itself holds on to a bounded few of them (it lets go of them now and
    # then), and a receiver of ever new shapes (sequence lengths) keeps buffers of the most recent few only.
    left = run_ranks(varying_shapes, 2)
    assert left[0] <= 16 and 1 <= left[1] <= 8


def crossed_streams(separate: bool) -> list[float]:
    """Rank 0 sends on stream 1, then on stream 0; rank 1 posts its receives the other way round."""
    init_mesh(2, timeout=30)
    transport = Transport(timeout=30, streams=2, separate_streams=separate)
    got: list[float] = []
    for _ in range(3):  # the third message of each stream is steady
        if dist.get_rank() == 0:
            transport.send(torch.full((3,), 1.0), 1, what="gradient", stream=1)
            transport.send(torch.full((2, 2), 2.0), 1, what="activation", stream=0)
        else:
            first = transport.irecv(0, what="activation", stream=0)
            second = transport.irecv(0, what="gradient", stream=1)
            got += [float(first.wait().sum()), float(second.wait().sum())]  # type: ignore[union-attr]
    transport.wait_sends()
    dist.barrier()
    dist.destroy_process_group()
    return got


@pytest.mark.parametrize("separate", [False, True], ids=["tags", "groups"])
def test_streams_stay_apart_whatever_the_order_of_posting(separate: bool) -> None:
    # With separate streams each has a process group of its own and the same tags as the other, as on NCCL,
    # which ignores tags: only the groups keep the messages apart.
    assert run_ranks(crossed_streams, 2, separate)[1] == [8.0, 3.0] * 3


def unknown_stream() -> list[str]:
    init_mesh(1, timeout=30)
    transport = Transport(timeout=30, streams=2)
    messages = []
    sending = functools.partial(transport.send, torch.ones(1), 0, what="x", stream=2)
    receiving = functools.partial(transport.irecv, 0, what="x", stream=2)
    for attempt in (sending, receiving):
        try:
            attempt()
        except ValueError as err:
            messages.append(str(err))
    dist.destroy_process_group()
    return messages


def test_a_stream_the_transport_does_not_have_is_refused() -> None:
    want = "stream 2 is not one of this transport's 2; use 0 .. 1, or create the Transport with streams=3"
    assert run_ranks(unknown_stream, 1)[0] == [want, want]


def bad_peers_and_conjugates() -> list[object]:
    init_mesh(2, timeout=30)
    transport = Transport(timeout=30)
    x = torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64)
    out: list[object] = []
    if dist.get_rank() == 0:
        for attempt in (lambda: transport.send(x, 0, what="x"), lambda: transport.send(x, 5, what="x"),
                        lambda: transport.irecv(0, what="x")):  # fmt: skip
            try:
                attempt()
            except ValueError as err:
                out.append(str(err))
        transport.send(x.conj(), 1, what="conjugate").wait()  # a lazy conjugate: its bit resolved on the way
        transport.send(-x, 1, what="negative").wait()
    else:
        out = [transport.recv(0, what="conjugate"), transport.recv(0, what="negative")]
    dist.destroy_process_group()
    return out


def test_bad_peers_are_refused_and_conjugate_views_arrive_resolved() -> None:
    # A send to oneself or to a rank outside the group gave gloo's assertions (and moved the channel's count);
    # a conjugate view failed in torch's isend after the control word had gone, so the stream fell out of step.
    results = run_ranks(bad_peers_and_conjugates, 2)
    assert results[0] == [
        "rank 0 cannot exchange with 0: a peer is another rank of this transport's group ([1])",
        "rank 0 cannot exchange with 5: a peer is another rank of this transport's group ([1])",
        "rank 0 cannot exchange with 0: a peer is another rank of this transport's group ([1])",
    ]
    conjugate, negative = results[1]  # type: ignore[misc]
    x = torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64)
    assert torch.equal(conjugate, x.conj().resolve_conj()) and torch.equal(negative, -x)


def close_with_a_receive_posted(dedicated: bool) -> str:
    init_mesh(2, timeout=30)
    transport = Transport(timeout=30, dedicated=dedicated)
    answer = "no receive"
    if dist.get_rank() == 1:
        handle = transport.irecv(0, what="x")
        try:
            transport.close()
            answer = "closed"
        except RuntimeError as err:
            answer = str(err)
        dist.barrier()
        handle.wait()  # the message arrives where it was awaited
        transport.close()
        transport.close()  # again: nothing happens
    else:
        dist.barrier()
        transport.send(torch.ones(2), 1, what="x").wait()
        transport.close()
    dist.destroy_process_group()
    return answer


@pytest.mark.parametrize("dedicated", [False, True])
def test_closing_with_a_receive_posted_is_refused(dedicated: bool) -> None:
    # Closed with a receive still posted, a transport on the default group left it there to take a later
    # transport's message (gloo then aborted the process); a dedicated one's second close failed.
    answer = run_ranks(close_with_a_receive_posted, 2, dedicated)[1]
    assert answer.startswith("rank 1's transport still has receives posted from rank 0 (stream 0); wait for them")
    assert ("close(wait=False) to drop them" in answer) == dedicated


def reuse_buffers() -> tuple[bool, bool, bool]:
    init_mesh(2, timeout=30)
    transport = Transport(timeout=30)
    if dist.get_rank() == 0:
        for value in (1.0, 2.0, 3.0):
            transport.send(torch.full((4, 4), value), 1, what="x").wait()
        transport.send(torch.full((5,), 4.0), 1, what="x").wait()
        dist.barrier()
        dist.destroy_process_group()
        return (True, True, True)
    first = transport.recv(0, what="x")
    assert isinstance(first, torch.Tensor)
    ptr, ok_first = first.data_ptr(), bool((first == 1).all())
    transport.release(first)
    del first
    second = transport.recv(0, what="x")
    assert isinstance(second, torch.Tensor)
    reused = second.data_ptr() == ptr and bool((second == 2).all())
    # Not released: the next receive must not overwrite it.
    third = transport.recv(0, what="x")
    assert isinstance(third, torch.Tensor)
    kept = bool((second == 2).all()) and bool((third == 3).all()) and third.data_ptr() != second.data_ptr()
    other = transport.recv(0, what="x")
    dist.barrier()
    dist.destroy_process_group()
    return (ok_first and reused, kept, bool((other == 4).all()))


def test_receive_buffers_are_reused_only_when_released() -> None:
    assert run_ranks(reuse_buffers, 2)[1] == (True, True, True)


def never_sent(timeout: float) -> str:
    init_mesh(2, timeout=60)
    transport = Transport(timeout=timeout)
    if dist.get_rank() == 0:
        start = time.perf_counter()
        try:
            transport.recv(1, what="the activation of micro-batch 3")
        except CommTimeoutError as err:
            assert (err.rank, err.peer) == (0, 1)
            return f"{time.perf_counter() - start:.1f}|{err}"
        return "no error"
    time.sleep(timeout + 1.5)  # alive past the timeout, but never sends
    return "slept"


def test_a_receive_that_never_comes_times_out_and_says_what() -> None:
    elapsed, message = run_ranks(never_sent, 2, 2.0, timeout=60)[0].split("|", 1)
    assert 1.5 <= float(elapsed) < 10
    assert message.startswith(
        "rank 0 timed out after 2 s waiting for the activation of micro-batch 3 (control word) from rank 1"
    )


def peer_dies(report: str) -> None:
    init_mesh(2, timeout=60)
    transport = Transport(timeout=20)
    dist.barrier()
    if dist.get_rank() == 1:
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGKILL)
    start = time.perf_counter()
    try:
        transport.recv(1, what="the gradient of micro-batch 0")
    except PeerGoneError as err:
        # written before raising: the agent may see rank 1's death first and stop this rank before it reports
        Path(report).write_text(f"{err} [after {time.perf_counter() - start:.1f} s]")
        raise


def test_a_killed_peer_makes_the_survivor_fail_not_hang(tmp_path: Path) -> None:
    report = tmp_path / "survivor.txt"
    with pytest.raises(LaunchError) as info:
        run_ranks(peer_dies, 2, str(report), monitor_interval=5.0, timeout=90)
    first, *then = info.value.failures
    assert (first.rank, first.exitcode) == (1, -signal.SIGKILL)  # rank 0 lingers until the agent notices rank 1
    # Rank 0 is listed after it if it had raised by the time the agent stopped it.
    assert all(f.rank == 0 and f.message.startswith("PeerGoneError: rank 0 lost rank 1") for f in then), then
    survivor = report.read_text()
    assert survivor.startswith("rank 0 lost rank 1 while waiting for the gradient of micro-batch 0"), survivor
    seconds = float(survivor.rsplit("[after ", 1)[1].split(" s]")[0])
    assert seconds < 20


def test_payloads_other_than_tensors_are_refused() -> None:
    for bad, shown in [
        (3, "int"),
        ([torch.zeros(1)], "\\['Tensor'\\]"),
        ((torch.zeros(1), None), "\\['Tensor', 'NoneType'\\]"),
        ((), "\\[\\]"),
    ]:
        with pytest.raises(TypeError, match=rf"a tensor or a non-empty tuple of tensors, got {shown}"):
            as_tensors(bad)


def test_metadata_round_trip_and_unsupported_dtypes() -> None:
    metas = tuple(TensorMeta.of(torch.zeros(2, 1, dtype=d)) for d in DTYPES)
    assert decode(encode(metas, is_tuple=True)) == (True, metas)
    with pytest.raises(TypeError, match=r"cannot send a tensor of dtype torch.uint16"):
        TensorMeta.of(torch.zeros(1, dtype=torch.uint16))
