"""Transport: payloads between a rank and its pipeline neighbours, with metadata sent only when it changes."""

from __future__ import annotations

import os
from collections import Counter, OrderedDict
from collections.abc import Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

from stagewise.comm.channel import Channel
from stagewise.comm.meta import TensorMeta, encode
from stagewise.comm.payload import Payload, PayloadLayout, as_tensors, has_bytes
from stagewise.comm.process_group_wire import ProcessGroupWire
from stagewise.comm.receiving import Receiving
from stagewise.comm.shared_memory import connect_shared_memory
from stagewise.comm.timeouts import DEFAULT_TIMEOUT, checked_timeout
from stagewise.comm.waits import Pending, Work, wait_for
from stagewise.comm.wire import Op, Wire

_POOL_DEPTH = 4  # buffers kept per (dtype, shape); more are left to the allocator
_POOL_SHAPES = 8  # (dtype, shape) pairs kept, the most recently released; older ones are dropped
_PRUNE_AT = 16  # sends in flight before the waited ones are first dropped from the list


class Transport:
    """Sends and receives payloads between this rank and its pipeline neighbours.

    Each message is a control word (the message's number, and 0 or the
    length of new metadata), the metadata when the payload's dtypes, shapes or
    requires-grad flags changed since the last message on the same (peer,
    stream), then the tensors, all posted as one batch of non-blocking
    operations in a fixed order. Nothing is pickled. A receiver learns a
    payload's layout once and again only when it changes, so variable
    sequence lengths work.

    On a wire that keeps tags apart (gloo, shared memory), a stream whose
    last two messages had the same layout, with some bytes of data, turns
    steady: the receiver posts the data receive, in the layout it knows,
    together with the control word's, so a steady stream adds no round trip
    before its data. When the layout changes, the sender sends the control
    word and the metadata, then a stand-in of the old layout to complete the
    posted data receive, then the new data; the stream is no longer steady
    until two messages agree again.

    A transport carries ``streams`` independent streams between each pair of
    ranks (a pipeline's activations and gradients), each in order, and
    :meth:`broadcast_along` besides, which needs no stream of the caller's.
    Where the backend is not gloo (NCCL ignores tags), or with
    ``separate_streams=True``, each stream gets a process group of its own
    (see :class:`~stagewise.comm.process_group_wire.ProcessGroupWire`).

    With ``dedicated=True`` (gloo), the transport creates a process group of
    its own over ``group``'s ranks, collectively (every rank of the default
    group must construct it, in the same order), and steady messages are the
    data alone, as raw ``send``/``recv`` would send them: the receiver keeps
    one control receive posted for the next change, which on a group of its
    own can take no one else's message. Messages between two ranks arrive in
    the order they were posted, so a stand-in never completes before its
    control word has landed: after each steady data receive the receiver
    reads the standing control buffer to learn whether it got data or a
    stand-in.

    The transport owns its wire (:class:`~stagewise.comm.wire.Wire`), which
    its callers never need to know. A dedicated transport on the CPU whose
    ranks share memory (one host, and ``/dev/shm`` visible to all) carries
    its messages through shared memory
    (:class:`~stagewise.comm.shared_memory.SharedMemoryWire`): the same
    protocol, with no gloo threads or sockets in the way. ``shared_memory``
    None does so where it can (unless the environment variable
    ``STAGEWISE_SHARED_MEMORY`` is ``0``), True insists, False keeps the
    process group (:class:`~stagewise.comm.process_group_wire.ProcessGroupWire`).

    Received tensors that required grad on the sender require grad here; integer
    and boolean tensors never do. ``release`` hands received tensors back for
    reuse by later receives of the same dtype and shape (a few each, for the
    most recently released shapes). A send keeps its tensors until it is
    waited for, by its own :meth:`Pending.wait` or by :meth:`wait_sends`;
    call one of them once per step or so.

    Every wait is bounded by ``timeout`` seconds; a timeout raises :class:`CommTimeoutError`,
    a dead peer :class:`PeerGoneError`, each naming this rank, the peer and what
    was awaited. Messages between two ranks on one stream must be received in
    the order they are sent.
    """

    def __init__(
        self,
        *,
        group: dist.ProcessGroup | None = None,
        device: torch.device | str = "cpu",
        timeout: float = DEFAULT_TIMEOUT,
        dedicated: bool = False,
        streams: int = 1,
        separate_streams: bool | None = None,
        shared_memory: bool | None = None,
    ) -> None:
        if not dist.is_initialized():
            raise RuntimeError("Transport needs an initialised process group; call stagewise.comm.init_mesh first")
        if isinstance(streams, bool) or not isinstance(streams, int) or streams < 1:
            raise ValueError(f"streams must be an int >= 1, got {streams!r}")
        self.device = torch.device(device)
        self.timeout = checked_timeout(timeout)
        """Seconds each wait may last."""
        self.rank = dist.get_rank()
        backend = dist.get_backend(group)
        self.standing = dedicated and backend == "gloo"
        """Steady streams drop their control words (gloo, on a group of this transport's own)."""
        ranks = None if group is None else dist.get_process_group_ranks(group)
        self._peers = frozenset(range(dist.get_world_size()) if ranks is None else ranks)
        eligible = self.standing and self.device.type == "cpu"  # what the shared-memory wire can stand in for
        if shared_memory and not eligible:
            raise ValueError(
                f"shared_memory=True needs a dedicated transport on the CPU over gloo; this one is "
                f"dedicated={dedicated} on {self.device} over {backend}"
            )
        if self.standing:
            group = dist.new_group(ranks, timeout=timedelta(seconds=self.timeout), backend="gloo")
        self.group = group
        wanted = os.environ.get("STAGEWISE_SHARED_MEMORY", "1") != "0" if shared_memory is None else shared_memory
        shared = self._shared_memory(insist=bool(shared_memory)) if eligible and wanted else None
        self.wire: Wire = (
            shared
            if shared is not None
            else ProcessGroupWire(group, streams=streams, separate=separate_streams, timeout=self.timeout)
        )
        """What carries the messages: shared memory between ranks of one host, or the process group."""
        self.speculate = self.wire.matches_tags
        """The wire keeps tags apart: a steady stream's data receive is posted with its control word's."""
        self.streams = streams
        self._sent: dict[tuple[int, int], Channel] = {}
        self._channels: dict[tuple[int, int], Channel] = {}
        self._pool: OrderedDict[tuple[torch.dtype, tuple[int, ...]], list[torch.Tensor]] = OrderedDict()
        self._in_flight: list[Pending] = []
        self._prune_at = _PRUNE_AT
        self._receiving: set[tuple[int, int]] = set()
        self._closed = False
        self._sending: Counter[int] = Counter()
        """Storages that sends in flight read, with how many sends read each (see :meth:`release`)."""

    def _shared_memory(self, *, insist: bool) -> Wire | None:
        """A shared-memory wire over this transport's own group (collective), or None where some rank cannot
        reach the others' shared memory (an error when ``insist``)."""
        assert self.group is not None
        wire = connect_shared_memory(self.group, self.rank)
        if wire is None and insist:
            dist.destroy_process_group(self.group)
            raise RuntimeError(
                f"rank {self.rank}: shared_memory=True, but not every rank of the transport can reach the "
                "others' shared memory (other hosts, or containers that do not share /dev/shm); pass "
                "shared_memory=None to fall back to gloo"
            )
        return wire

    def _ops(self, send: bool, tensors: Sequence[torch.Tensor], peer: int, tag: int) -> list[Op]:
        return [Op(send, t, peer, tag) for t in tensors if t.numel()]

    def _post(self, ops: list[Op]) -> list[Work]:
        """Post ``ops`` in order on the wire."""
        return self.wire.post(ops) if ops else []

    def _check_open(self, peer: object) -> None:
        if self._closed:
            raise RuntimeError(f"rank {self.rank}'s transport is closed; make a new one to exchange with {peer!r}")

    def _check_peer(self, peer: int) -> None:
        self._check_open(peer)
        if isinstance(peer, bool) or not isinstance(peer, int) or peer == self.rank or peer not in self._peers:
            raise ValueError(
                f"rank {self.rank} cannot exchange with {peer!r}: a peer is another rank of this transport's group "
                f"({sorted(self._peers - {self.rank})})"
            )

    def _check_stream(self, stream: int) -> None:
        if not 0 <= stream < self.streams:
            raise ValueError(
                f"stream {stream} is not one of this transport's {self.streams}; "
                f"use 0 .. {self.streams - 1}, or create the Transport with streams={stream + 1}"
            )

    def send(self, payload: Payload, to: int, *, what: str, stream: int = 0, known: bool = False) -> Pending:
        """Post ``payload`` to rank ``to`` without waiting; returns the sends in flight.

        With ``known=True`` the receiver already knows the layout (it passes
        ``expect`` to :meth:`irecv`), so only the data travels. Do not change
        the payload's tensors in place until the sends complete
        (:meth:`Pending.wait` or :meth:`wait_sends`).
        """
        self._check_stream(stream)
        self._check_peer(to)
        tensors, is_tuple = as_tensors(payload)
        # Everything that can fail comes before the channel's state changes: a conjugate or negative view
        # resolved, as the wire needs plain memory.
        data = [t.detach().resolve_conj().resolve_neg().to(self.device).contiguous() for t in tensors]
        if known:
            return self._start(self._post(self._ops(True, data, to, 2 * stream + 1)), to, what, data)
        layout: PayloadLayout = (is_tuple, tuple(TensorMeta.of(t) for t in tensors))
        channel = self._sent.setdefault((to, stream), Channel())
        channel.count += 1
        same = channel.layout == layout
        steady = self.speculate and channel.stable
        control: list[torch.Tensor] = []
        if not same:
            header = encode(layout[1], is_tuple=is_tuple).to(self.device)
            control = [self._word(channel.count, header.numel()), header]
        elif not (steady and self.standing):
            control = [self._word(channel.count, 0)]
        if steady and not same:
            # The receiver has posted a receive of the old layout: complete it with a stand-in first.
            assert channel.layout is not None
            data = [m.empty(self.device).zero_() for m in channel.layout[1]] + data
        ops = self._ops(True, control, to, 2 * stream) + self._ops(True, data, to, 2 * stream + 1)
        channel.stable = same and has_bytes(layout)  # a zero-byte stream has no data to wait on: never steady
        channel.layout = layout
        return self._start(self._post(ops), to, what, control + data)

    def _word(self, number: int, words: int) -> torch.Tensor:
        """A control word: the message's number, and the length of the metadata that follows (0: none)."""
        return torch.tensor([number, words], dtype=torch.int64, device=self.device)

    def _start(self, works: list[Work], to: int, what: str, keep: list[torch.Tensor]) -> Pending:
        """Sends posted: kept in flight, with their tensors, until waited for."""
        pending = Pending(works, self.rank, to, what, self.timeout, keep, done=self._sent_off)
        for t in keep:
            self._sending[t.untyped_storage().data_ptr()] += 1
        if len(self._in_flight) >= self._prune_at:
            # Let go of the sends already waited for, now and then (amortised: the list is rebuilt only when
            # it doubles). Gloo cannot tell whether a send has completed without waiting for it, so the
            # others stay until wait_sends().
            self._in_flight = [p for p in self._in_flight if p.works]
            self._prune_at = max(_PRUNE_AT, 2 * len(self._in_flight))
        self._in_flight.append(pending)
        return pending

    def _sent_off(self, tensors: Sequence[torch.Tensor]) -> None:
        """A send has completed: its tensors' memory may be reused (see :meth:`release`)."""
        for t in tensors:
            key = t.untyped_storage().data_ptr()
            self._sending[key] -= 1
            if self._sending[key] <= 0:
                del self._sending[key]

    def broadcast_along(self, group: dist.ProcessGroup, source: int, tensor: torch.Tensor, *, what: str) -> None:
        """Fill ``tensor`` with rank ``source``'s on every rank of ``group``, a process group over exactly the
        ranks to reach (all of them this transport's), each of which calls this with a contiguous tensor of the
        same dtype and shape on the transport's device.

        The wire decides how it travels: through shared memory, a message from
        ``source`` to each rank, which wakes no gloo thread on either side;
        over a process group, torch's broadcast over ``group``. On ``source`` the
        sends stay in flight, waited for with the others (:meth:`wait_sends`);
        elsewhere the wait is bounded by the timeout, and a timeout or a lost
        peer is named after ``what``.
        """
        self._check_open(source)
        ranks = dist.get_process_group_ranks(group)
        if self.rank not in ranks or source not in ranks or not self._peers.issuperset(ranks):
            raise ValueError(
                f"rank {self.rank} cannot broadcast from rank {source} over ranks {ranks}: the group must hold "
                f"this rank and the source, all of them ranks of this transport's group ({sorted(self._peers)})"
            )
        if tensor.device != self.device or not tensor.is_contiguous():
            raise ValueError(
                f"broadcast_along needs a contiguous tensor on the transport's device ({self.device}), got one on "
                f"{tensor.device}{'' if tensor.is_contiguous() else ', not contiguous'}; pass tensor.contiguous()"
            )
        if len(ranks) == 1:
            return
        for peer, work in self.wire.broadcast(tensor, source, group):
            if self.rank == source:
                self._start([work], peer, what, [tensor])
            else:
                wait_for(work, rank=self.rank, peer=peer, what=what, timeout=self.timeout, sending=False)

    def close(self, *, wait: bool = True) -> None:
        """Close the wire and destroy the process groups this transport made (``dedicated``, per-stream), with
        their threads and sockets, after waiting for the sends in flight (``wait=False``: dropping them, as after
        an error); it sends and receives nothing after. Closing again does nothing."""
        if self._closed:
            return
        exclusive = self.standing or self.wire.exclusive
        if self._receiving and (wait or not exclusive):
            # On a group it does not own, a posted receive would outlive the transport and take another's message.
            posted = ", ".join(f"rank {src} (stream {stream})" for src, stream in sorted(self._receiving))
            drop = (
                "or close(wait=False) to drop them (after an error: their data is lost)"
                if exclusive
                else "on a group this transport does not own they cannot be dropped"
            )
            raise RuntimeError(
                f"rank {self.rank}'s transport still has receives posted from {posted}; wait for them before "
                f"closing ({drop})"
            )
        self._closed = True
        try:
            if wait:
                self.wait_sends()
        finally:
            self._in_flight = []
            self.wire.close()
            if self.standing and self.group is not None:
                group, self.group = self.group, None  # its threads and sockets go with the last reference to it
                dist.destroy_process_group(group)

    def wait_sends(self) -> None:
        """Wait for every send posted so far (bounded by the timeout each)."""
        in_flight, self._in_flight = self._in_flight, []
        for pending in in_flight:
            pending.wait()

    def recv(self, src: int, *, what: str, stream: int = 0) -> Payload:
        """Receive the next payload from rank ``src`` on ``stream``; blocks up to the timeout per wait."""
        return self.irecv(src, what=what, stream=stream).wait()

    def irecv(self, src: int, *, what: str, stream: int = 0, expect: PayloadLayout | None = None) -> Receiving:
        """Post the receive of the next payload from ``src`` now; :meth:`Receiving.wait` completes it.

        ``expect`` is the layout when both sides know it (the sender passes
        ``known=True``): then only data travels. At most one receive per
        (peer, stream) may be outstanding: the next one's protocol depends on
        what this one brings.
        """
        self._check_stream(stream)
        self._check_peer(src)
        key = (src, stream)
        if key in self._receiving:
            raise RuntimeError(
                f"rank {self.rank} already has a receive from rank {src} on stream {stream} outstanding; "
                "wait for it before posting the next"
            )
        handle = Receiving(self, src, stream, what, expect)
        self._receiving.add(key)
        return handle

    # What a Receiving asks of its transport (see receiving.Receiver).

    def _channel_from(self, src: int, stream: int) -> Channel:
        return self._channels.setdefault((src, stream), Channel())

    def _received(self, src: int, stream: int) -> None:
        self._receiving.discard((src, stream))

    def _receive(self, tensors: Sequence[torch.Tensor], src: int, tag: int, what: str) -> None:
        self._wait_all(self._post(self._ops(False, tensors, src, tag)), src, what)

    def _wait_all(self, works: Sequence[Work], src: int, what: str) -> None:
        for work in works:
            wait_for(work, rank=self.rank, peer=src, what=what, timeout=self.timeout, sending=False)

    def _take(self, meta: TensorMeta) -> torch.Tensor:
        stack = self._pool.get((meta.dtype, meta.shape))
        if stack:
            return stack.pop()
        return meta.empty(self.device)

    def release(self, payload: Payload) -> None:
        """Hand received tensors back for reuse; only pass tensors nothing refers to any more.

        A tensor whose memory a send still in flight reads (a stage that passes a received gradient on as a view
        of it) is not reused: gloo reads a send's data only when the receiver asks for it.
        """
        tensors, _ = as_tensors(payload)
        for t in tensors:
            if t.device != self.device or t.grad_fn is not None or t.untyped_storage().data_ptr() in self._sending:
                continue
            key = (t.dtype, tuple(t.shape))
            stack = self._pool.setdefault(key, [])
            self._pool.move_to_end(key)
            if len(self._pool) > _POOL_SHAPES:  # varying shapes (sequence lengths): keep the recent ones
                self._pool.popitem(last=False)
            if len(stack) < _POOL_DEPTH:
                t.requires_grad_(False)
                t.grad = None
                stack.append(t)
