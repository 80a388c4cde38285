"""Channel: what both ends of one (peer, stream) direction of a transport know after each message."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from stagewise.comm.payload import PayloadLayout
from stagewise.comm.waits import Work


@dataclass
class Channel:
    """What both ends of one (peer, stream) direction know after each message."""

    layout: PayloadLayout | None = None
    """The layout of the last message."""
    stable: bool = False
    """True when the last message had the same layout as the one before it."""
    count: int = 0
    """Messages so far; each control word carries its message's number."""
    standing: torch.Tensor | None = None
    """Receiver, gloo, stable: the buffer of the control receive left posted for the next change of layout."""
    standing_work: Work | None = None
    notice: tuple[int, int] | None = None
    """Receiver: a change of layout announced for a later message, (its number, metadata length)."""
