"""The time model's actions: what each kind of pass costs a layer, with and without recomputation."""

from __future__ import annotations

import pytest

from stagewise.plan.time_model import Overlapped, action_seconds


def test_a_checkpointed_weight_pass_recomputes_and_walks_the_whole_backward_again() -> None:
    # Forward 1, backward 2, tensor-parallel collectives 0.1 and 0.2, recomputation 0.6.
    plain = action_seconds((1.0, 2.0), (0.1, 0.2), None, Overlapped(), overlap=False)
    assert (plain.input_grad, plain.weight_grad) == pytest.approx((1.2, 1.0))
    assert plain.backward == pytest.approx(2.2)
    # Checkpointed: I recomputes (0.6 and the forward's 0.1 of collectives) and passes the gradient on; W
    # recomputes again and, holding none of the gradients I found, passes it through the layer again (2 + 0.2).
    ckpt = action_seconds((1.0, 2.0), (0.1, 0.2), 0.6, Overlapped(), overlap=False)
    assert (ckpt.input_grad, ckpt.weight_grad) == pytest.approx((1.0 + 0.2 + 0.7, 2.2 + 0.7))
    assert ckpt.backward == pytest.approx(2.2 + 0.7)


def test_transfers_beside_an_action_add_to_it_without_a_side_stream_and_overlap_with_one() -> None:
    moved = Overlapped(gather=0.5, scatter=0.3, host=0.0)
    serial = action_seconds((1.0, 2.0), (0.0, 0.0), None, moved, overlap=False)
    side = action_seconds((1.0, 2.0), (0.0, 0.0), None, moved, overlap=True)
    assert (serial.forward, serial.backward) == pytest.approx((1.5, 2.8))
    assert (side.forward, side.backward) == pytest.approx((1.0, 2.0))
