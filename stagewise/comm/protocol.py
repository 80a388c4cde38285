"""The transport's message protocol: a control word, metadata only when the layout changes, then the data.

Each message of a :class:`~stagewise.comm.transport.Transport` is a control
word (the message's number, and 0 or the length of new metadata), the
metadata when the payload's dtypes, shapes or requires-grad flags changed
since the last message on the same (peer, stream), then the tensors, all
posted as one batch of non-blocking operations in a fixed order. Nothing is
pickled (:mod:`stagewise.comm.meta`). A receiver learns a payload's layout
once and again only when it changes, so variable sequence lengths work.
Stream ``s`` carries its control words and metadata on tag ``2s``
(:func:`control_tag`) and its data on tag ``2s + 1`` (:func:`data_tag`).

On a wire that keeps tags apart (gloo, shared memory), a stream whose last
two messages had the same layout, with some bytes of data, turns steady: the
receiver posts the data receive, in the layout it knows, together with the
control word's, so a steady stream adds no round trip before its data. When
the layout changes, the sender sends the control word and the metadata, then
a stand-in of the old layout to complete the posted data receive, then the
new data; the stream is no longer steady until two messages agree again.

On a group of the transport's own (``dedicated=True``, gloo), steady
messages are the data alone, as raw ``send``/``recv`` would send them: the
receiver keeps one control receive posted for the next change (*standing*),
which on a group of its own can take no one else's message. Messages between
two ranks arrive in the order they were posted, so a stand-in never
completes before its control word has landed: after each steady data receive
the receiver reads the standing control buffer to learn whether it got data
or a stand-in (:mod:`stagewise.comm.receiving`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from stagewise.comm.channel import Channel
from stagewise.comm.meta import encode
from stagewise.comm.payload import PayloadLayout, has_bytes
from stagewise.comm.wire import Op


def control_tag(stream: int) -> int:
    """The tag of ``stream``'s control words and metadata."""
    return 2 * stream


def data_tag(stream: int) -> int:
    """The tag of ``stream``'s data (and stand-ins)."""
    return 2 * stream + 1


def ops(send: bool, tensors: Sequence[torch.Tensor], peer: int, tag: int) -> list[Op]:
    """A send or a receive of each of ``tensors`` that has elements (an empty one travels as nothing)."""
    return [Op(send, t, peer, tag) for t in tensors if t.numel()]


def control_word(number: int, words: int, device: torch.device) -> torch.Tensor:
    """A control word: the message's number, and the length of the metadata that follows (0: none)."""
    return torch.tensor([number, words], dtype=torch.int64, device=device)


@dataclass(frozen=True)
class Message:
    """One message as its sender posts it: the control word and metadata (either may be absent), then the data."""

    control: list[torch.Tensor]
    data: list[torch.Tensor]

    def ops(self, peer: int, stream: int) -> list[Op]:
        """The sends that carry the message to ``peer`` on ``stream``, in order."""
        return ops(True, self.control, peer, control_tag(stream)) + ops(True, self.data, peer, data_tag(stream))

    @property
    def tensors(self) -> list[torch.Tensor]:
        """Every tensor the sends read, to keep until they complete."""
        return self.control + self.data


def next_message(
    channel: Channel,
    layout: PayloadLayout,
    data: list[torch.Tensor],
    *,
    device: torch.device,
    speculate: bool,
    standing: bool,
) -> Message:
    """The message that carries ``data``, of ``layout``, next on the sender's ``channel``, whose state it advances.

    ``speculate``: the wire keeps tags apart, so a steady stream's receiver has
    its data receive posted already; ``standing``: steady messages drop their
    control words (a dedicated transport over gloo).
    """
    channel.count += 1
    same = channel.layout == layout
    steady = speculate and channel.stable
    control: list[torch.Tensor] = []
    if not same:
        header = encode(layout[1], is_tuple=layout[0]).to(device)
        control = [control_word(channel.count, header.numel(), device), header]
    elif not (steady and standing):
        control = [control_word(channel.count, 0, device)]
    if steady and not same:
        # The receiver has posted a receive of the old layout: complete it with a stand-in first.
        assert channel.layout is not None
        data = [m.empty(device).zero_() for m in channel.layout[1]] + data
    channel.stable = same and has_bytes(layout)  # a zero-byte stream has no data to wait on: never steady
    channel.layout = layout
    return Message(control, data)
