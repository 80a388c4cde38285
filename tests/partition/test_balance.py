"""balance(): examples, the memory-aware cases, and every bad input refused with a clear message."""

from __future__ import annotations

import logging
import math

import numpy as np
import pytest

from stagewise.partition import CapacityError, MemoryModel, balance


def test_known_split() -> None:
    part = balance([1, 2, 3, 4, 5, 6], 3)
    assert part.bounds == (0, 3, 5, 6)
    assert part.loads == (6.0, 9.0, 6.0)
    assert part.bottleneck == 9.0


def test_one_stage_takes_everything() -> None:
    part = balance([3.0, 1.0, 2.0], 1)
    assert part.bounds == (0, 3)
    assert part.bottleneck == 6.0


def test_as_many_stages_as_layers() -> None:
    assert balance([5, 1, 1, 5], 4).bounds == (0, 1, 2, 3, 4)


def test_faster_device_takes_more() -> None:
    part = balance([1.0] * 12, 2, speeds=[1.0, 3.0])
    assert part.bounds == (0, 3, 12)
    assert part.times == (3.0, 3.0)


def test_memory_capacity_moves_the_boundary() -> None:
    weights = [1.0] * 8
    free = balance(weights, 2)
    assert free.bounds == (0, 4, 8)
    tight = balance(weights, 2, memory=[10.0] * 4 + [1.0] * 4, capacities=[25.0, 100.0])
    assert tight.bounds == (0, 2, 8)
    assert tight.memory == (20.0, 24.0)


def test_one_f_one_b_memory_model_is_respected() -> None:
    # Stage 0 holds 4 micro-batches, stage 1 holds 1: activation-heavy layers go late.
    model = MemoryModel(fixed=(0.0,) * 6, activation=(1.0,) * 6, in_flight=(4, 1))
    part = balance([1.0] * 6, 2, memory=model, capacities=[8.0, 8.0])
    assert part.bounds == (0, 2, 6)
    assert part.memory == (8.0, 4.0)


def test_balancing_memory_itself() -> None:
    model = MemoryModel(fixed=(1.0,) * 6, activation=(1.0,) * 6, in_flight=(2, 1))
    part = balance(model, 2)
    # Stage 0 pays 3 bytes a layer, stage 1 pays 2: 2 and 4 layers give 6 and 8; 3 and 3 give 9 and 6.
    assert part.bounds == (0, 2, 6)
    assert part.bottleneck == 8.0


def test_large_input_is_fast_path_and_valid() -> None:
    rng = np.random.default_rng(0)
    w = rng.random(100_000)
    part = balance(w, 64)
    assert len(part.bounds) == 65
    assert part.bottleneck >= max(w.max(), w.sum() / 64)
    assert part.bottleneck <= max(w.max(), w.sum() / 64) * 1.001


def test_inputs_are_not_changed() -> None:
    w = np.array([3.0, 1.0, 2.0])
    mem = [1.0, 1.0, 1.0]
    balance(w, 2, memory=mem, capacities=[5.0, 5.0])
    assert w.tolist() == [3.0, 1.0, 2.0] and mem == [1.0, 1.0, 1.0]


def test_zero_weights_are_allowed() -> None:
    part = balance([0.0, 0.0, 0.0], 2)
    assert part.bottleneck == 0.0 and part.imbalance == 1.0


# --- bad input: each names the values and the fix -------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "error", "pattern"),
    [
        ({"n_stages": 0}, ValueError, r"n_stages must be >= 1, got 0"),
        ({"n_stages": -2}, ValueError, r"n_stages must be >= 1, got -2"),
        ({"n_stages": 2.0}, TypeError, r"n_stages must be an int, got float"),
        ({"n_stages": True}, TypeError, r"n_stages must be an int, got bool"),
        ({"n_stages": 5}, ValueError, r"cannot split 3 layers into 5 non-empty stages; use n_stages <= 3"),
        ({"weights": []}, ValueError, r"no layers to split \(weights is empty\)"),
        ({"weights": [1.0, -2.0, 3.0]}, ValueError, r"weights\[1\] is -2\.0; every entry must be finite and >= 0"),
        ({"weights": [1.0, float("nan"), 3.0]}, ValueError, r"weights\[1\] is nan"),
        ({"weights": [1.0, 2.0, float("inf")]}, ValueError, r"weights\[2\] is inf"),
        ({"weights": [1e308, 1e308, 1.0]}, ValueError, r"weights sum to inf, which overflows float64; scale them down"),
        ({"weights": "abc"}, TypeError, r"weights must be a sequence of numbers, got str"),
        ({"weights": [1.0, "x", 2.0]}, TypeError, r"weights must be a sequence of numbers"),
        ({"weights": [[1.0, 2.0]]}, ValueError, r"weights must be one-dimensional, got shape \(1, 2\)"),
        ({"speeds": [1.0]}, ValueError, r"speeds has 1 entries but there are 2; give exactly 2"),
        ({"speeds": [1.0, 0.0]}, ValueError, r"speeds\[1\] is 0\.0; every entry must be positive and finite"),
        ({"speeds": [-1.0, 1.0]}, ValueError, r"speeds\[0\] is -1\.0"),
        ({"memory": [1.0, 1.0]}, ValueError, r"memory has 2 entries but there are 3; give exactly 3"),
        ({"memory": [1.0, 1.0, 1.0], "capacities": [5.0]}, ValueError, r"capacities has 1 entries but there are 2"),
        ({"memory": [1.0, 1.0, 1.0], "capacities": [5.0, 0.0]}, ValueError, r"capacities\[1\] is 0\.0"),
        (
            {"memory": [1.0, 1.0, 1.0], "capacities": [-5.0, 5.0]},
            ValueError,
            r"capacities\[0\] is -5\.0; every entry must be positive and finite",
        ),
        (
            {"weights": [1e300, 1e300, 1.0], "speeds": [1e-10, 1.0]},
            ValueError,
            r"sum 2e\+300 over the slowest speed 1e-10 overflows float64; scale the weights down or the speeds up",
        ),
        (
            {"weights": [1e-300, 0.0, 1e-300], "speeds": [1e30, 1.0]},
            ValueError,
            r"smallest positive weight 1e-300 over the fastest speed 1e\+30 underflows float64 to 0",
        ),
        ({"capacities": [5.0, 5.0]}, ValueError, r"capacities were given without memory; pass memory="),
        ({"names": ["a", "b"]}, ValueError, r"names has 2 entries but there are 3 layers"),
        (
            {"memory": MemoryModel((1.0,) * 3, (0.0,) * 3, (1, 1, 1))},
            ValueError,
            r"in-flight counts for 3 stages but n_stages is 2",
        ),
        ({"memory": MemoryModel((1.0,) * 4, (0.0,) * 4, (1, 1))}, ValueError, r"describes 4 layers but there are 3"),
    ],
)
def test_bad_input(kwargs: dict[str, object], error: type[Exception], pattern: str) -> None:
    args: dict[str, object] = {"weights": [1.0, 2.0, 3.0], "n_stages": 2} | kwargs
    weights, n_stages = args.pop("weights"), args.pop("n_stages")
    with pytest.raises(error, match=pattern):
        balance(weights, n_stages, **args)  # type: ignore[arg-type]


def test_layer_larger_than_every_capacity_is_named() -> None:
    with pytest.raises(
        CapacityError,
        match=r"layer 2 \('blocks.1'\) alone needs 50 B on stage 1, where it comes closest to fitting "
        r"\(capacity 40 B\), and more than the capacity on every other stage",
    ) as info:
        balance(
            [1.0] * 4,
            2,
            memory=[1.0, 1.0, 50.0, 1.0],
            capacities=[30.0, 40.0],
            names=["embed", "blocks.0", "blocks.1", "head"],
        )
    assert info.value.layer == 2 and info.value.stage is None and info.value.overflow == 10.0


def test_layer_too_big_is_measured_against_the_stage_it_comes_closest_to_fitting() -> None:
    # Stage 0 holds 4 micro-batches: layer 0 needs 400 B there against 100 B; on stage 1, 100 B against 50 B.
    model = MemoryModel(fixed=(0.0, 0.0), activation=(100.0, 1.0), in_flight=(4, 1))
    with pytest.raises(CapacityError, match=r"layer 0 alone needs 100 B on stage 1, .*\(capacity 50 B\)") as info:
        balance([1.0, 1.0], 2, memory=model, capacities=[100.0, 50.0])
    assert info.value.layer == 0 and info.value.overflow == 50.0


def test_weights_that_rounding_loses_are_reported(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="stagewise.partition.balance"):
        balance([2.0**40, 1.0, 3.0], 2)  # every sum is exact in float64
    assert not caplog.records
    with caplog.at_level(logging.WARNING, logger="stagewise.partition.balance"):
        balance([1e17, 1.0, 2.0], 2)  # 1e17 + 1 rounds to 1e17
    assert "change 2 of 3 layers' weights" in caplog.text and "exact only for the rounded sums" in caplog.text


def test_unmeetable_capacities_name_the_overflowing_stage() -> None:
    # 4 layers of 10 bytes in 2 stages of 15: the best split needs 20 somewhere.
    with pytest.raises(
        CapacityError, match=r"stage 0 \(layers 0:2, a .. b\) needs 20 B > capacity 15 B, over by 5 B"
    ) as info:
        balance([1.0] * 4, 2, memory=[10.0] * 4, capacities=[15.0, 15.0], names=["a", "b", "c", "d"])
    assert info.value.stage == 0 and info.value.overflow == 5.0
    assert math.isclose(info.value.overflow, 5.0)


def test_the_readme_example() -> None:
    part = balance([3.0, 1.0, 4.0, 1.0, 5.0, 9.0, 2.0, 6.0], n_stages=3)
    assert part.bounds == (0, 4, 6, 8)
    assert part.loads == (9.0, 14.0, 8.0)
    assert part.bottleneck == 14.0
    assert part.stage_of(5) == 1
