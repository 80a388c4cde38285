"""Transport: payloads between a rank and its pipeline neighbours, with metadata sent only when it changes."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from stagewise.comm.buffers import BufferPool, SendsInFlight
from stagewise.comm.channel import Channel
from stagewise.comm.meta import TensorMeta
from stagewise.comm.payload import Payload, PayloadLayout, as_tensors
from stagewise.comm.protocol import data_tag, next_message, ops
from stagewise.comm.receiving import Receiving
from stagewise.comm.timeouts import DEFAULT_TIMEOUT, checked_timeout
from stagewise.comm.waits import Pending, Work, wait_for
from stagewise.comm.wire import Op, Wire
from stagewise.comm.wire_choice import choose_wire
from stagewise.errors import is_whole, whole_number


class Transport:
    """Sends and receives payloads between this rank and its pipeline neighbours.

    A payload is a tensor or a tuple of tensors. Its dtypes, shapes and
    requires-grad flags travel as small integer tensors, never pickled, once,
    and again only when they change, so variable sequence lengths work (the
    protocol: :mod:`stagewise.comm.protocol`). A transport carries ``streams``
    independent streams between each pair of ranks (a pipeline's activations
    and gradients), each in order, and :meth:`broadcast_along` besides, which
    needs no stream of the caller's. It owns its wire (shared memory between
    ranks of one host, or a process group: :mod:`stagewise.comm.wire_choice`),
    which its callers never need to know.

    Received tensors that required grad on the sender require grad here;
    integer and boolean tensors never do. :meth:`release` hands received
    tensors back for reuse by later receives of the same dtype and shape. A
    send keeps its tensors until it is waited for, by its own
    :meth:`Pending.wait` or by :meth:`wait_sends`; call one of them once per
    step or so.

    Every wait is bounded by ``timeout`` seconds; a timeout raises :class:`CommTimeoutError`,
    a dead peer :class:`PeerGoneError`, each naming this rank, the peer and what
    was awaited. Messages between two ranks on one stream must be received in
    the order they are sent.

    Args:
        group: the ranks to exchange with (None: every rank).
        device: where payloads travel from and arrive.
        timeout: seconds each wait may last.
        dedicated: make a process group of this transport's own over ``group``'s ranks (collective: every rank
            of the default group constructs it, in the same order); over gloo, steady messages are then the data
            alone.
        streams: independent, ordered streams between each pair of ranks.
        separate_streams: a process group per stream (default: where the backend ignores tags, as NCCL does).
        shared_memory: carry a dedicated CPU transport's messages through shared memory: None where every rank
            can, True insists, False never.
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
        whole_number("streams", streams, least=1, fix="give 1 (the default) or more")
        self.device = torch.device(device)
        self.timeout = checked_timeout(timeout)
        """Seconds each wait may last."""
        self.rank = dist.get_rank()
        ranks = None if group is None else dist.get_process_group_ranks(group)
        self._peers = frozenset(range(dist.get_world_size()) if ranks is None else ranks)
        chosen = choose_wire(
            group,
            rank=self.rank,
            device=self.device,
            dedicated=dedicated,
            streams=streams,
            separate_streams=separate_streams,
            shared_memory=shared_memory,
            timeout=self.timeout,
        )
        self.standing = chosen.standing
        """Steady streams drop their control words (gloo, on a group of this transport's own)."""
        self.group = chosen.group
        self.wire: Wire = chosen.wire
        """What carries the messages: shared memory between ranks of one host, or the process group."""
        self.speculate = self.wire.matches_tags
        """The wire keeps tags apart: a steady stream's data receive is posted with its control word's."""
        self.streams = streams
        self._sent: dict[tuple[int, int], Channel] = {}
        self._channels: dict[tuple[int, int], Channel] = {}
        self._pool = BufferPool(self.device)
        self._sends = SendsInFlight()
        self._receiving: set[tuple[int, int]] = set()
        self._closed = False

    def _post(self, posted: list[Op]) -> list[Work]:
        """Post ``posted`` in order on the wire."""
        return self.wire.post(posted) if posted else []

    def _check_open(self, peer: object) -> None:
        if self._closed:
            raise RuntimeError(f"rank {self.rank}'s transport is closed; make a new one to exchange with {peer!r}")

    def _check_peer(self, peer: int) -> None:
        self._check_open(peer)
        if not is_whole(peer) or peer == self.rank or peer not in self._peers:
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
            return self._start(self._post(ops(True, data, to, data_tag(stream))), to, what, data)
        layout: PayloadLayout = (is_tuple, tuple(TensorMeta.of(t) for t in tensors))
        channel = self._sent.setdefault((to, stream), Channel())
        message = next_message(
            channel, layout, data, device=self.device, speculate=self.speculate, standing=self.standing
        )
        return self._start(self._post(message.ops(to, stream)), to, what, message.tensors)

    def _start(self, works: list[Work], to: int, what: str, keep: list[torch.Tensor]) -> Pending:
        """Sends posted: kept in flight, with their tensors, until waited for."""
        return self._sends.start(works, rank=self.rank, peer=to, what=what, timeout=self.timeout, keep=keep)

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
            self._sends.drop()
            self.wire.close()
            if self.standing and self.group is not None:
                group, self.group = self.group, None  # its threads and sockets go with the last reference to it
                dist.destroy_process_group(group)

    def wait_sends(self) -> None:
        """Wait for every send posted so far (bounded by the timeout each)."""
        self._sends.wait_all()

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
        self._wait_all(self._post(ops(False, tensors, src, tag)), src, what)

    def _wait_all(self, works: Sequence[Work], src: int, what: str) -> None:
        for work in works:
            wait_for(work, rank=self.rank, peer=src, what=what, timeout=self.timeout, sending=False)

    def _take(self, meta: TensorMeta) -> torch.Tensor:
        return self._pool.take(meta)

    def release(self, payload: Payload) -> None:
        """Hand received tensors back for reuse; only pass tensors nothing refers to any more.

        A tensor whose memory a send still in flight reads (a stage that passes a received gradient on as a view
        of it) is not reused: gloo reads a send's data only when the receiver asks for it.
        """
        tensors, _ = as_tensors(payload)
        for t in tensors:
            if t.device != self.device or t.grad_fn is not None or self._sends.reads(t):
                continue
            self._pool.keep(t)
