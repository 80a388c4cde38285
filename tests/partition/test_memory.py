"""The memory model: in-flight micro-batches from the schedule's own actions, and bytes per stage."""

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
    MemorySetting,
    Tie,
    balance,
    balance_costs,
    layers_of,
    memory_model,
    profile,
    shared_parameters,
)
from stagewise.partition.auto import params_of
from stagewise.schedule import Schedule, build, holdings, peak_in_flight
from stagewise.schedule.holdings import Holding


def cost(name: str, param_bytes: int, buffer_bytes: int, saved: int, pooled: int = 0, use: int = 0) -> LayerCost:
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
        use_bytes=use,
    )


def in_flight(name: str, p: int, m: int) -> tuple[int, ...]:
    """What the memory model counts per stage under the built schedule ``name``."""
    return memory_model([cost("a", 4, 0, 1)], schedule=build(name, p, m)).in_flight  # type: ignore[arg-type]


def test_in_flight_per_schedule() -> None:
    assert in_flight("gpipe", 4, 8) == (8, 8, 8, 8)
    assert in_flight("1f1b", 4, 8) == (4, 3, 2, 1)
    assert in_flight("1f1b", 4, 2) == (2, 2, 2, 1)
    assert in_flight("zero-bubble", 3, 8) == (5, 4, 3)  # held until the weight pass, which comes p - 1 later


@pytest.mark.parametrize("p", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 7, 8, 12, 16])
def test_the_schedules_own_counts_are_the_textbook_ones(p: int, m: int) -> None:
    # What the closed forms said before the memory model read the schedules: 1F1B stage s of p holds
    # min(p - s, m), GPipe all m, zero-bubble min(2p - 1 - s, m) (until the weight pass, p - 1 later).
    textbook = {
        "gpipe": tuple(m for _ in range(p)),
        "1f1b": tuple(min(p - s, m) for s in range(p)),
        "zero-bubble": tuple(min(2 * p - 1 - s, m) for s in range(p)),
    }
    for name, counts in textbook.items():
        assert in_flight(name, p, m) == peak_in_flight(build(name, p, m)) == counts, (name, p, m)  # type: ignore[arg-type]


def test_without_a_schedule_each_stage_holds_one_micro_batch() -> None:
    assert memory_model([cost("a", 4, 0, 1)], 3).in_flight == (1, 1, 1) == in_flight("1f1b", 3, 1)


@pytest.mark.parametrize(
    ("kwargs", "error", "pattern"),
    [
        ({"schedule": "1f1b"}, TypeError, r"schedule must be a built Schedule, got str: pass "
         r"stagewise.schedule.build\('1f1b', n_stages, n_microbatches\)"),
        ({}, TypeError, r"memory_model needs n_stages \(an int\) or schedule=stagewise.schedule.build"),
        ({"n_stages": 0}, ValueError, r"n_stages must be >= 1, got 0"),
        ({"n_stages": 3, "schedule": build("1f1b", 2, 4)}, ValueError,
         r"n_stages=3 but the schedule '1f1b' has 2 stages; leave n_stages out"),
        ({"n_stages": 1, "holdings": ((Holding(1),),)}, ValueError, r"holdings come from a schedule: pass it too"),
    ],
)  # fmt: skip
def test_memory_model_refuses_what_is_not_a_schedule(kwargs: dict[str, object], error: type, pattern: str) -> None:
    with pytest.raises(error, match=pattern):
        memory_model([cost("a", 4, 0, 1)], **kwargs)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"n_microbatches must be >= 1, got 0"):
        build("1f1b", 2, 0)


def test_a_split_backward_also_keeps_its_output_gradients() -> None:
    # Read off the schedule (splits_backward), not its name: zero-bubble's I keeps what its W starts from.
    costs = [cost("a", 0, 0, 100, pooled=60, use=7), cost("b", 0, 0, 50, pooled=80, use=9)]
    split = build("zero-bubble", 2, 4)
    whole = build("1f1b", 2, 4)
    assert split.splits_backward and not whole.splits_backward
    assert memory_model(costs, schedule=split, holdings=holdings(split)).pooled == (67.0, 89.0)
    assert memory_model(costs, schedule=whole, holdings=holdings(whole)).pooled == (60.0, 80.0)
    assert memory_model(costs, schedule=split).pooled == ()  # without holdings only the micro-batches in flight
    # A schedule read from text splits its backward the same way, whatever it is called.
    custom = Schedule.from_text(split.to_text(), name="mine")
    assert memory_model(costs, schedule=custom, holdings=holdings(custom)).pooled == (67.0, 89.0)


def test_balance_costs_takes_its_memory_setting() -> None:
    costs = [cost(n, 40, 0, 100) for n in "abcd"]
    schedule = build("1f1b", 2, 8)
    given = balance_costs(costs, 2, by="memory", memory=MemorySetting(schedule))
    assert given == balance_costs(costs, 2, by="memory", n_microbatches=8)  # short for 1F1B over the stages
    assert given.loads == (2 * 160 + 2 * 200, 2 * 160 + 1 * 200)  # two layers each; stage 0 holds two micro-batches
    assert balance_costs(costs, 2, by="memory").loads == (2 * 160 + 200, 2 * 160 + 200)  # one micro-batch each
    with pytest.raises(ValueError, match=r"n_microbatches=4 is short for a 1F1B schedule, but memory already has"):
        balance_costs(costs, 2, memory=MemorySetting(schedule), n_microbatches=4)
    with pytest.raises(ValueError, match=r"schedule '1f1b' has 2 stages but the partition has 4; build the schedule"):
        balance_costs(costs, 4, memory=MemorySetting(schedule))
    with pytest.raises(ValueError, match=r"state_multiplier must be >= 0 and finite, got -1"):
        balance_costs(costs, 2, memory=MemorySetting(state_multiplier=-1.0))


def test_memory_model_counts_state_buffers_and_activations() -> None:
    costs = [cost("a", 400, 8, 100), cost("b", 800, 0, 50)]
    model = memory_model(costs, schedule=build("1f1b", 2, 8), state_multiplier=4.0)
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
    model = memory_model(costs, schedule=build("1f1b", 2, 8), state_multiplier=0.0, holdings=moments)
    assert model.stage_bytes(0, 0, 3) == 2 * 180  # stage 0 pools nothing
    assert model.stage_bytes(1, 0, 3) == max(180 + 140, 2 * 140)
    assert model.stage_bytes(1, 1, 2) == max(50 + 80, 2 * 80)  # b alone: two pooled backwards are the fuller moment
    plain = memory_model(costs, schedule=build("1f1b", 2, 8), state_multiplier=0.0)
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
    part = balance_costs(costs, 2, memory=MemorySetting(state_multiplier=1.3), capacities=[1e9, 1e9], shared=shared)
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
