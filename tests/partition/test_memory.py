"""The memory model: in-flight micro-batches per schedule, and bytes per stage."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from stagewise.models import preset
from stagewise.partition import (
    CapacityError,
    LayerCost,
    MemoryModel,
    Tie,
    balance,
    balance_costs,
    in_flight,
    layers_of,
    memory_model,
    params_of,
    profile,
    shared_parameters,
)
from stagewise.schedule import Holding, build, peak_in_flight


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
    assert in_flight("zero-bubble", 3, 8) == (5, 4, 3)  # held until the weight pass, which comes p - 1 later
    for p, m in ((1, 1), (2, 4), (3, 2), (4, 5), (4, 8), (3, 12)):  # what the schedules themselves hold
        for name in ("gpipe", "1f1b", "zero-bubble"):
            assert in_flight(name, p, m) == peak_in_flight(build(name, p, m)), (name, p, m)  # type: ignore[arg-type]


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


def test_a_stage_keeps_one_copy_of_a_tied_weight() -> None:
    """What a stage of a tied GPT counts equals the parameters its layers really hold, for every split."""
    config = preset("gpt-tiny-tied")
    model = config.build(device="meta")
    layers = layers_of(model)
    shared = shared_parameters(layers)
    assert len(shared) == 1 and shared[0].indices == (0, len(layers) - 1)
    costs = profile(model, config.example(2))
    memory = memory_model(costs, 1, state_multiplier=4.0, shared=shared)
    n = len(layers)
    for start in range(n):
        for stop in range(start + 1, n + 1):
            held = {id(p): p for layer in layers[start:stop] for p in layer.module.parameters()}.values()
            assert params_of(costs, shared, range(start, stop)) == sum(p.numel() for p in held)
            buffers = sum(b.numel() * b.element_size() for layer in layers[start:stop] for b in layer.module.buffers())
            assert (
                memory.fixed_bytes(range(start, stop)) == 4 * sum(p.numel() * p.element_size() for p in held) + buffers
            )
    # The whole model on one stage: its parameters once, as model.parameters() lists them.
    whole = balance_costs(costs, 1, by="params", shared=shared)
    assert whole.params == (sum(p.numel() for p in model.parameters()),)
    assert whole.loads == (float(whole.params[0]),)
    assert whole.params[0] < sum(c.params for c in costs)  # what each layer counts: the tie twice


def test_ties_that_do_not_fit_their_layers_are_refused() -> None:
    fixed = (4.0, 1.0, 4.0)
    with pytest.raises(ValueError, match=r"ties\[0\].layers is \[2, 0\]; give distinct indices in ascending order"):
        MemoryModel(fixed, (0.0,) * 3, (1,), ties=(Tie((2, 0), 1.0),))
    with pytest.raises(ValueError, match=r"ties\[0\].layers is \[0, 3\]; .* from 0 to 2"):
        MemoryModel(fixed, (0.0,) * 3, (1,), ties=(Tie((0, 3), 1.0),))
    with pytest.raises(ValueError, match=r"ties\[0\].amount must be finite and >= 0, got nan"):
        MemoryModel(fixed, (0.0,) * 3, (1,), ties=(Tie((0, 2), math.nan),))
    with pytest.raises(ValueError, match=r"ties\[1\] makes the ties of layer 1 add up to 2.0, more than its own value"):
        MemoryModel(fixed, (0.0,) * 3, (1,), ties=(Tie((0, 1), 1.0), Tie((1, 2), 1.0)))
    with pytest.raises(ValueError, match=r"ties\[0\] makes the ties of layer 1 add up to 3.0, more than its own"):
        balance([4.0, 1.0, 4.0], 2, ties=[Tie((0, 1), 3.0)])
    with pytest.raises(ValueError, match=r"beside a MemoryModel as weights; put them in the model's ties"):
        balance(MemoryModel(fixed, (0.0,) * 3, (1,)), 1, ties=[Tie((0, 2), 1.0)])


def test_ties_round_like_the_sizes_they_come_from() -> None:
    # A layer holding two tied tensors: nbytes * 1.3 of each can add up to an ulp more than param_bytes * 1.3.
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6))
    model[2].weight, model[2].bias = model[0].weight, model[0].bias
    costs = profile(model, torch.zeros(2, 6, device="meta"))
    shared = shared_parameters(layers_of(model))
    part = balance_costs(costs, 2, state_multiplier=1.3, capacities=[1e9, 1e9], shared=shared)
    assert part.params == (42, 42)
    # Indices from numpy are whole numbers too.
    assert balance([4.0, 1.0, 4.0], 1, ties=[Tie((np.int64(0), np.int64(2)), 1.0)]).loads == (8.0,)


def test_sizes_that_overflow_or_round_say_so() -> None:
    with pytest.raises(ValueError, match=r"memory: all layers together on stage 0 come to inf, which overflows"):
        balance([1.0, 1.0, 1.0], 3, memory=[1e308, 1e308, 1e308])
    huge = MemoryModel(fixed=(1.0,) * 3, activation=(1e308,) * 3, in_flight=(1, 1, 1))
    with pytest.raises(ValueError, match=r"weights: all layers together on stage 0 come to inf"):
        balance(huge, 3)
    # Fractions of a GiB: 0.2 + 0.3 comes to 0.5000000000000001 as a difference of prefix sums.
    rounding = r"needs 0.5000000000000001 > capacity 0.5, over by 1.1102230246251565e-16 \(float64 sums round: "
    with pytest.raises(CapacityError, match=rounding + r"give sizes in whole bytes, or a capacity a little larger\)"):
        balance([1.0, 1.0, 1.0], 2, memory=[0.1, 0.2, 0.3], capacities=[0.1, 0.5])
