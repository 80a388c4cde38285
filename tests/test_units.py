"""Byte sizes read from and written for people."""

from __future__ import annotations

import pytest

from stagewise.units import format_bytes, parse_bytes


@pytest.mark.parametrize(
    ("text", "value"),
    [("80GiB", 80 * 2**30), ("40GB", 40e9), ("8e10", 8e10), ("512 MiB", 512 * 2**20), ("1.5kb", 1500.0)],
)
def test_parse(text: str, value: float) -> None:
    assert parse_bytes(text) == value


@pytest.mark.parametrize("text", ["", "GiB", "80 parsecs", "-1GiB", "0"])
def test_parse_rejects(text: str) -> None:
    with pytest.raises(ValueError, match=r"size"):
        parse_bytes(text)


def test_format() -> None:
    assert format_bytes(3 * 2**30) == "3.00 GiB"
    assert format_bytes(1536) == "1.50 KiB"
    assert format_bytes(12) == "12 B"
