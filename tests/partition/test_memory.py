"""The memory model: in-flight micro-batches per schedule, and bytes per stage."""

from __future__ import annotations

import pytest

from stagewise.partition import Holding, LayerCost, MemoryModel, in_flight, memory_model


def cost(name: str, param_bytes: int, buffer_bytes: int, saved: int, pooled: int = 0) -> LayerCost:
    return LayerCost(
        name=name,
        params=param_bytes // 4,
        param_bytes=param_bytes,
        buffer_bytes=buffer_bytes,
        flops=0,
        forward_flops=0,
        output_bytes=0,
        saved_bytes=saved,
        time=None,
        pooled_bytes=pooled,
    )


def test_in_flight_per_schedule() -> None:
    assert in_flight("gpipe", 4, 8) == (8, 8, 8, 8)
    assert in_flight("1f1b", 4, 8) == (4, 3, 2, 1)
    assert in_flight("1f1b", 4, 2) == (2, 2, 2, 1)
    assert in_flight("zero-bubble", 3, 8) == (3, 2, 1)


@pytest.mark.parametrize(
    ("args", "pattern"),
    [
        (("pipedream", 2, 2), r"unknown schedule 'pipedream'.*'gpipe', '1f1b', 'zero-bubble'"),
        (("1f1b", 0, 2), r"n_stages must be >= 1, got 0"),
        (("1f1b", 2, 0), r"n_microbatches must be >= 1, got 0"),
    ],
)
def test_in_flight_bad_input(args: tuple[str, int, int], pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        in_flight(*args)  # type: ignore[arg-type]


def test_memory_model_counts_state_buffers_and_activations() -> None:
    costs = [cost("a", 400, 8, 100), cost("b", 800, 0, 50)]
    model = memory_model(costs, 2, schedule="1f1b", n_microbatches=8, state_multiplier=4.0)
    assert model.fixed == (1608.0, 3200.0)
    assert model.activation == (100.0, 50.0)
    assert model.in_flight == (2, 1)
    assert model.stage_bytes(0, 0, 2) == 1608 + 3200 + 2 * 150
    assert model.stage_bytes(1, 1, 2) == 3200 + 50


def test_memory_model_bad_input() -> None:
    with pytest.raises(ValueError, match=r"state_multiplier must be >= 0 and finite, got -1"):
        memory_model([cost("a", 4, 0, 0)], 1, state_multiplier=-1.0)
    with pytest.raises(ValueError, match=r"state_multiplier must be >= 0 and finite, got nan"):
        memory_model([cost("a", 4, 0, 0)], 1, state_multiplier=float("nan"))
    with pytest.raises(ValueError, match=r"2 fixed sizes, 1 activation sizes and 0 pooled sizes"):
        MemoryModel((1.0, 2.0), (1.0,), (1,))
    with pytest.raises(ValueError, match=r"in_flight must be >= 0"):
        MemoryModel((1.0,), (1.0,), (-1,))
    with pytest.raises(ValueError, match=r"holdings for 1"):
        MemoryModel((1.0,), (1.0,), (1, 1), (1.0,), ((Holding(1),),))
    with pytest.raises(ValueError, match=r"holdings\[0\] must be one or more moments with counts >= 0"):
        MemoryModel((1.0,), (1.0,), (1,), (1.0,), ((Holding(1, -1),),))
    with pytest.raises(ValueError, match=r"holdings\[0\] must be one or more moments"):
        MemoryModel((1.0,), (1.0,), (1,), (), ((),))
    with pytest.raises(ValueError, match=r"3 shared sizes for 2 layers"):
        MemoryModel((1.0, 1.0), (1.0, 1.0), (1,), shared=(0.0, 0.0, 0.0))
    with pytest.raises(ValueError, match=r"shared\[1\] = 3.0 must be between 0 and the activation of layer 1 and"):
        MemoryModel((1.0, 1.0), (2.0, 5.0), (1,), shared=(0.0, 3.0))


def test_a_stage_needs_its_fullest_moment() -> None:
    # Stage 1 of 1F1B on 2 ranks pooling 2 backwards: one in flight and one pooled, or two pooled at the flush.
    costs = [cost("a", 0, 0, 100, 60), cost("b", 0, 0, 50, 80), cost("c", 0, 0, 30, 0)]
    moments = ((Holding(2),), (Holding(1, 1), Holding(0, 2)))
    model = memory_model(costs, 2, schedule="1f1b", n_microbatches=8, state_multiplier=0.0, holdings=moments)
    assert model.stage_bytes(0, 0, 3) == 2 * 180  # stage 0 pools nothing
    assert model.stage_bytes(1, 0, 3) == max(180 + 140, 2 * 140)
    assert model.stage_bytes(1, 1, 2) == max(50 + 80, 2 * 80)  # b alone: two pooled backwards are the fuller moment
    plain = memory_model(costs, 2, schedule="1f1b", n_microbatches=8, state_multiplier=0.0)
    assert (plain.pooled, plain.holdings, plain.stage_bytes(1, 0, 3)) == ((), (), 180)
