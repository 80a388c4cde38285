"""The GPT reference model: presets, meta construction, and config checks."""

from __future__ import annotations

import pytest
import torch

from stagewise.models import PRESETS, GPTConfig, build


def test_presets_build_on_meta_with_their_sizes() -> None:
    sizes = {name: sum(p.numel() for p in build(name, device="meta").parameters()) for name in PRESETS}
    assert sizes["gpt-small"] == pytest.approx(124e6, rel=0.01)  # GPT-2 small, embedding and head tied
    assert sizes["gpt-7b"] == pytest.approx(6.7e9, rel=0.01)
    assert sizes["gpt-70b"] == pytest.approx(70e9, rel=0.01)
    assert all(p.is_meta for p in build("gpt-7b", device="meta").parameters())


def test_forward_shape_and_causality() -> None:
    torch.manual_seed(0)
    model = build("gpt-tiny")
    ids = torch.randint(0, 256, (2, 16))
    logits = model(ids)
    assert logits.shape == (2, 16, 256)
    changed = ids.clone()
    changed[:, -1] = (changed[:, -1] + 1) % 256
    # Changing the last token leaves every earlier position's logits alone.
    torch.testing.assert_close(model(changed)[:, :-1], logits[:, :-1])


def test_bad_config_and_name() -> None:
    with pytest.raises(ValueError, match=r"n_heads=3 must divide d_model=128"):
        GPTConfig(n_heads=3)
    with pytest.raises(ValueError, match=r"GPTConfig.n_layers must be >= 1, got 0"):
        GPTConfig(n_layers=0)
    with pytest.raises(ValueError, match=r"unknown model preset 'gpt-huge'"):
        build("gpt-huge")


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_a_sequence_longer_than_the_positions_is_refused(device: str) -> None:
    config = GPTConfig(vocab_size=16, seq_len=8, d_model=16, n_layers=1, n_heads=2)
    model = config.build(device=device)
    model(torch.zeros(2, 8, dtype=torch.int64, device=device))
    with pytest.raises(ValueError, match=r"a sequence of 9 tokens is longer than the model's 8 positions"):
        model(torch.zeros(2, 9, dtype=torch.int64, device=device))
