"""Partition: lookups, the report, and the JSON round trip."""

from __future__ import annotations

import pytest

from stagewise.partition import Partition, balance


def test_lookups_agree_with_bounds() -> None:
    part = Partition.from_bounds([0, 2, 5, 6])
    assert part.n_stages == 3 and part.n_layers == 6
    assert [part.stage_of(i) for i in range(6)] == [0, 0, 1, 1, 1, 2]
    assert [list(part.layers(s)) for s in range(3)] == [[0, 1], [2, 3, 4], [5]]
    assert part.loads == (2.0, 3.0, 1.0) and part.bottleneck == 3.0
    assert part.imbalance == pytest.approx(1.5)
    with pytest.raises(IndexError, match=r"layer 6 out of range; this partition has 6 layers"):
        part.stage_of(6)
    with pytest.raises(IndexError, match=r"stage 3 out of range"):
        part.layers(3)


def test_json_round_trip() -> None:
    part = balance(
        [1.0, 2.0, 3.0, 4.0],
        2,
        speeds=[1.0, 2.0],
        memory=[1.0, 1.0, 2.0, 2.0],
        capacities=[10.0, 10.0],
        names=["a", "b", "c", "d"],
    )
    again = Partition.from_json(part.to_json())
    assert again == part


def test_report_lists_every_stage() -> None:
    part = balance([1.0, 2.0, 3.0, 4.0], 2, memory=[2**30] * 4, capacities=[2**32] * 2, names=["e", "b0", "b1", "h"])
    text = part.report()
    lines = text.splitlines()
    assert lines[0].split() == [
        "stage",
        "layers",
        "first",
        "..",
        "last",
        "params",
        "load",
        "share",
        "time",
        "memory",
        "capacity",
    ]
    assert "e .. b1" in lines[2] and "6" in lines[2] and "60.0%" in lines[2] and "3.00 GiB" in lines[2]
    assert "h .. h" in lines[3] and "4.00 GiB" in lines[3]
    assert lines[-1].startswith("bottleneck 6, imbalance 1.200")


@pytest.mark.parametrize(
    ("bounds", "pattern"),
    [
        ((0, 2, 2, 4), r"strictly increase \(no empty stage\), got \[0, 2, 2, 4\]"),
        ((1, 3), r"must start at 0"),
        ((0,), r"must start at 0"),
    ],
)
def test_invalid_bounds(bounds: tuple[int, ...], pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        Partition(bounds=bounds, loads=(1.0,) * max(len(bounds) - 1, 0), speeds=(1.0,) * max(len(bounds) - 1, 0))


def test_field_lengths_are_checked() -> None:
    with pytest.raises(ValueError, match=r"loads has 1 entries for 2 stages"):
        Partition(bounds=(0, 1, 2), loads=(1.0,), speeds=(1.0, 1.0))
    with pytest.raises(ValueError, match=r"names has 1 entries for 2 layers"):
        Partition(bounds=(0, 1, 2), loads=(1.0, 1.0), speeds=(1.0, 1.0), names=("a",))


@pytest.mark.parametrize(
    ("text", "pattern"),
    [
        ("{not json", r"not a JSON partition"),
        ("[1, 2]", r"an object with at least 'bounds'"),
        ('{"bounds": [0, 1], "colour": 3}', r"unknown fields in JSON partition: \['colour'\]"),
        ('{"bounds": [0, 2], "speeds": [0]}', r"speeds in a JSON partition must be finite numbers > 0, got \[0\]"),
        ('{"bounds": [0, 2.7]}', r"bounds in a JSON partition must be finite whole numbers >= 0, got \[0, 2.7\]"),
        ('{"bounds": [0, 2], "loads": [NaN]}', r"loads in a JSON partition must be finite numbers >= 0"),
        ('{"bounds": [0, 2], "memory": ["x"]}', r"memory in a JSON partition must be a list of numbers, got \['x'\]"),
        ('{"bounds": [0, 3], "names": "abc"}', r"names in a JSON partition must be a list of strings, got 'abc'"),
        ('{"bounds": null}', r"bounds must start at 0 and strictly increase"),
    ],
)
def test_bad_json(text: str, pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        Partition.from_json(text)
