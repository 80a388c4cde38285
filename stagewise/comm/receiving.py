"""Receiving: a payload posted by Transport.irecv, read as control words, metadata when the layout changes, data.

The receiver's side of the protocol of :mod:`stagewise.comm.protocol`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from stagewise.comm.channel import Channel
from stagewise.comm.errors import CommError
from stagewise.comm.meta import TensorMeta, decode
from stagewise.comm.payload import Payload, PayloadLayout, has_bytes
from stagewise.comm.protocol import control_tag, data_tag, ops
from stagewise.comm.waits import Work
from stagewise.comm.wire import Op


class Receiver(Protocol):
    """What a receive needs of the transport that posted it (:class:`~stagewise.comm.transport.Transport`)."""

    device: torch.device
    rank: int
    speculate: bool
    """The wire keeps tags apart: a steady stream's data receive is posted with its control word's."""
    standing: bool
    """Steady streams drop their control words: one control receive stays posted for the next change."""

    def _channel_from(self, src: int, stream: int) -> Channel: ...
    def _post(self, posted: list[Op]) -> list[Work]: ...
    def _take(self, meta: TensorMeta) -> torch.Tensor: ...
    def _wait_all(self, works: Sequence[Work], src: int, what: str) -> None: ...
    def _receive(self, tensors: Sequence[torch.Tensor], src: int, tag: int, what: str) -> None: ...
    def _received(self, src: int, stream: int) -> None: ...
    def release(self, payload: Payload) -> None: ...


_NO_CONTROL = torch.empty(0, dtype=torch.int64)


class Receiving:
    """A posted receive; :meth:`wait` returns the payload (see :meth:`Transport.irecv`)."""

    def __init__(
        self, transport: Receiver, src: int, stream: int, what: str, expect: PayloadLayout | None = None
    ) -> None:
        self.transport, self.src, self.stream, self.what = transport, src, stream, what
        t = transport
        self.expect = expect
        self.channel = channel = t._channel_from(src, stream)
        self.buffers: list[torch.Tensor] = []
        self.result: Payload | None = None
        self.control = _NO_CONTROL  # a buffer only where a control word is awaited with this message
        self.control_work: Work | None = None
        self.steady = False
        if expect is not None:
            self.buffers = [t._take(m) for m in expect[1]]
            self.data_works = t._post(ops(False, self.buffers, src, data_tag(stream)))
            return
        self.steady = t.speculate and channel.stable
        if self.steady:
            self._post_steady()
        else:
            self.control_work = t._post(ops(False, [self._control_buffer()], src, control_tag(stream)))[0]
            self.data_works = []

    def _post_steady(self) -> None:
        """Post the data receive in the layout the stream keeps, with the control word's where one comes."""
        t, channel, src, stream = self.transport, self.channel, self.src, self.stream
        assert channel.layout is not None
        if not t.standing:
            control = [self._control_buffer()]
        else:  # the control word comes only with a change: leave one receive posted for it
            control = []
            if channel.standing is None and channel.notice is None:
                channel.standing = torch.zeros(2, dtype=torch.int64, device=t.device)
                control = [channel.standing]
        self.buffers = [t._take(m) for m in channel.layout[1]]
        works = t._post(ops(False, control, src, control_tag(stream)) + ops(False, self.buffers, src, data_tag(stream)))
        if control and t.standing:
            channel.standing_work = works.pop(0)
        elif control:
            self.control_work = works.pop(0)
        self.data_works = works

    def _control_buffer(self) -> torch.Tensor:
        self.control = torch.empty(2, dtype=torch.int64, device=self.transport.device)
        return self.control

    def _announced(self, number: int) -> int:
        """After a steady message's data receive: the metadata length when it was a stand-in, else 0."""
        t, channel = self.transport, self.channel
        notice = channel.notice
        if notice is None and channel.standing is not None and int(channel.standing[0].item()) != 0:
            # A control word has landed (or is landing) in the standing receive: complete it and read it.
            assert channel.standing_work is not None
            t._wait_all([channel.standing_work], self.src, f"{self.what} (control word)")
            notice = (int(channel.standing[0].item()), int(channel.standing[1].item()))
            channel.standing = channel.standing_work = None
        if notice is not None and notice[0] == number:
            channel.notice = None
            return notice[1]
        channel.notice = notice  # none, or a change announced for a later message
        return 0

    def wait(self) -> Payload:
        """The payload; blocks up to the transport's timeout per wait."""
        if self.result is not None:
            return self.result
        t = self.transport
        try:
            if self.expect is not None:
                t._wait_all(self.data_works, self.src, self.what)
                buffers, layout = self.buffers, self.expect
            else:
                buffers, layout = self._read()
        finally:
            t._received(self.src, self.stream)
        for b, m in zip(buffers, layout[1], strict=True):
            b.requires_grad_(m.requires_grad)
        self.result = tuple(buffers) if layout[0] else buffers[0]
        return self.result

    def _read(self) -> tuple[list[torch.Tensor], PayloadLayout]:
        """The message's buffers and layout, after its control word, metadata (if any) and data."""
        t, src, stream, what, channel = self.transport, self.src, self.stream, self.what, self.channel
        channel.count += 1
        # The data (or the stand-in for the old layout) follows its control word, so waiting for the
        # data first leaves nothing to wait for in the control word: one wake-up per message, not two.
        t._wait_all(self.data_works, src, what)
        words = self._announced(channel.count) if self.steady and t.standing else self._control_word()
        buffers = self.buffers
        if words:
            if buffers:
                t.release(tuple(buffers))  # the sender's stand-in for the old layout
                buffers = []
            header = torch.empty(words, dtype=torch.int64, device=t.device)
            t._receive([header], src, control_tag(stream), f"{what} (metadata)")
            layout = decode(header.cpu())
        elif channel.layout is None:
            raise CommError(
                f"rank {t.rank} got a payload from rank {src} without metadata on stream {stream}; "
                "both sides must exchange messages in the same order",
                rank=t.rank,
                peer=src,
                what=what,
            )
        else:
            layout = channel.layout
        if not buffers:
            buffers = [t._take(m) for m in layout[1]]
            t._receive(buffers, src, data_tag(stream), what)
        channel.stable = not words and has_bytes(layout)
        channel.layout = layout
        return buffers, layout

    def _control_word(self) -> int:
        """Wait for this message's control word; the length of the metadata that follows (0: none)."""
        t, src, what, channel = self.transport, self.src, self.what, self.channel
        assert self.control_work is not None
        t._wait_all([self.control_work], src, f"{what} (control word)")
        number, words = (int(v) for v in self.control.tolist())
        if number != channel.count:
            raise CommError(
                f"rank {t.rank} got message {number} from rank {src} on stream {self.stream} where it expected "
                f"message {channel.count}; both sides must exchange messages in the same order",
                rank=t.rank,
                peer=src,
                what=what,
            )
        return words
