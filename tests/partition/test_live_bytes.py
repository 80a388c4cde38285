"""LiveBytes: bytes of the tensors made under it while they live, and their peak, alike on meta and the CPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from stagewise.partition.live_bytes import LiveBytes


@pytest.mark.parametrize("device", ["meta", "cpu"])
def test_live_bytes_counts_each_new_storage_once_while_it_lives(device: str) -> None:
    before = torch.zeros(1000, device=device)  # made before: neither it nor its views count
    with LiveBytes() as live:
        view = before.view(10, 100)
        before.add_(1)  # in place: the same storage
        assert live.current == 0
        a = torch.empty(250, device=device)
        b = a.view(25, 10)  # one storage, counted once
        c = a * 2
        assert live.current == 2000
        del a, b
        assert live.current == 1000  # the views' storage is freed with the last of them
        del c
        assert live.current == 0 and live.peak == 2000
    del view


def test_live_bytes_on_meta_is_what_the_cpu_holds_in_a_forward_and_backward() -> None:
    # Cross-entropy's backward holds the logits' log-softmax and the gradients of both at once: 3 logits-sized
    # tensors, the peak on both devices.
    peaks = []
    for device in ("meta", "cpu"):
        logits = torch.zeros(64, 1000, device=device, requires_grad=True)
        target = torch.zeros(64, dtype=torch.long, device=device)
        with LiveBytes() as live:
            F.cross_entropy(logits, target).backward()
        peaks.append(live.peak)
        assert live.current == logits.numel() * 4  # what stays: the leaf's gradient
    assert peaks[0] == peaks[1]
    assert 3 * 64 * 1000 * 4 <= peaks[0] < 3 * 64 * 1000 * 4 + 64
