"""capture(): models that are not chains, captured by torch.export and cut at their repeated blocks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from stagewise.models.nonchain import MaskedTransformer, UNetMLP
from stagewise.partition import CaptureError, auto, capture, layers_of, profile, shared_parameters
from stagewise.partition.capture import repeated_blocks
from stagewise.pipeline import materialise_model, torch_pipe
from stagewise.pipeline.stage.materialise import materialise


def inputs(batch: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 64, (batch, 8), generator=g)
    mask = torch.ones(batch, 8, dtype=torch.long)
    mask[0, 5:] = 0
    return ids, mask


def test_a_masked_transformer_becomes_a_chain_that_computes_the_same() -> None:
    torch.manual_seed(0)
    model = MaskedTransformer()
    chain = capture(model, inputs(3))
    layers = layers_of(chain)
    assert [layer.name for layer in layers] == ["<input>", "blocks.0", "blocks.1", "blocks.2", "blocks.3"]
    # hidden states, mask, cos and sin travel between blocks; the last returns the logits
    assert [s.graph.receives for s in chain.segments] == [2, 4, 4, 4, 4]
    assert [s.graph.emits for s in chain.segments] == [4, 4, 4, 4, 1]
    assert list(chain.state_dict()) == list(model.state_dict())
    for batch in (1, 3, 5):  # the batch dimension stays symbolic
        x = inputs(batch, seed=batch)
        torch.testing.assert_close(chain(*x), model(*x), atol=0, rtol=0)
    x = inputs(4)
    want = torch.autograd.grad(model(*x).square().mean(), list(model.parameters()))
    got = torch.autograd.grad(chain(*x).square().mean(), list(model.parameters()))
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


def test_skip_connections_are_passed_along_and_shared_weights_found() -> None:
    torch.manual_seed(0)
    model = UNetMLP(n_layers=6)
    x = torch.randn(4, 16)
    chain = capture(model, x)
    # the input projection reaches the head, and block i's output reaches block 5 - i
    assert [s.graph.emits for s in chain.segments] == [1, 2, 3, 4, 3, 2, 1]
    torch.testing.assert_close(chain(x), model(x), atol=0, rtol=0)
    (tie,) = shared_parameters(layers_of(chain))
    assert tie.names == ("mix", "mix", "mix") and tie.layers == ("blocks.2", "blocks.3", "blocks.4")


def test_the_partitioner_chooses_among_the_block_boundaries() -> None:
    model = MaskedTransformer(n_layers=6, device="meta")
    example = tuple(t.to("meta") for t in inputs(2))
    chain = capture(model, example)
    costs = profile(chain, example)
    assert [c.name for c in costs] == ["<input>", *repeated_blocks(model)]
    assert len({c.flops for c in costs[1:-1]}) == 1  # identical blocks cost the same
    part = auto(chain, 3, example, by="flops")
    assert part.n_stages == 3 and part.bounds[0] == 0 and part.bounds[-1] == 7
    assert set(part.split_spec(chain)) <= set(repeated_blocks(model))


def test_a_meta_model_is_materialised_segment_by_segment_on_the_cpu() -> None:
    model = MaskedTransformer(device="meta")
    chain = capture(model, tuple(t.to("meta") for t in inputs(2)))
    materialise_model(chain, seed=3)
    assert not any(p.is_meta for p in model.parameters())
    x = inputs(3)
    # the mask's torch.ones(..., device=meta) of the capture now runs on the CPU
    torch.testing.assert_close(chain(*x), model(*x), atol=0, rtol=0)
    again = capture(MaskedTransformer(device="meta"), tuple(t.to("meta") for t in inputs(2)))
    materialise_model(again, seed=3)
    for (name, a), b in zip(chain.state_dict().items(), again.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, atol=0, rtol=0, msg=name)


class CachedScale(nn.Module):
    """A block with a non-persistent buffer that reset_parameters() fills (a cache, as of rotary angles)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.register_buffer("scale", torch.empty(d), persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        self.fc.reset_parameters()
        with torch.no_grad():
            self.scale.copy_(torch.linspace(0.5, 1.5, len(self.scale)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = torch.relu(self.fc(x)) * self.scale
        return out


class CachedNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(CachedScale(8) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def test_a_non_persistent_buffer_stays_the_models_through_materialisation() -> None:
    # torch.export keeps non-persistent buffers among its constants: the segments read the meta tensor captured
    # at capture, so a meta model, once materialised, could not run or be profiled.
    with torch.device("meta"):
        model = CachedNet()
    chain = capture(model, torch.zeros(2, 8, device="meta"))
    materialise_model(chain, seed=0)
    assert not any(b.is_meta for b in model.buffers())
    x = torch.randn(4, 8)
    torch.testing.assert_close(chain(x), model(x), atol=0, rtol=0)
    assert profile(chain, x, time=True)[0].time is not None
    assert set(chain.state_dict()) == set(model.state_dict())  # still not saved


class NormBlock(nn.Module):
    """A residual block whose batch norm and dropout behave differently in training and in eval mode."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc, self.bn, self.drop = nn.Linear(d, d), nn.BatchNorm1d(d), nn.Dropout(0.25)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = x + self.drop(torch.relu(self.bn(self.fc(x))))
        return out


class NormNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp, self.head = nn.Linear(4, 8), nn.Linear(8, 2)
        self.blocks = nn.ModuleList(NormBlock(8) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        out: torch.Tensor = self.head(h)
        return out


def test_an_example_of_one_sample_captures_a_chain_for_any_batch() -> None:
    # torch.export fixes a dimension of size 1: the example is shown twice, and the batch stays symbolic.
    torch.manual_seed(0)
    model = UNetMLP()
    chain = capture(model, torch.randn(1, 16))
    for batch in (1, 3):
        x = torch.randn(batch, 16)
        torch.testing.assert_close(chain(x), model(x), atol=0, rtol=0)


def test_a_model_captured_in_eval_mode_comes_back_in_it_and_profiles() -> None:
    torch.manual_seed(0)
    model, x = NormNet().eval(), torch.randn(6, 4)
    chain = capture(model, x)
    assert not chain.training and not any(s.training for s in chain.segments)
    torch.testing.assert_close(chain(x), model(x), atol=0, rtol=0)  # it runs as captured, with nothing to set
    costs = profile(chain, x)  # each segment in the mode it was captured in
    assert len(costs) == 4 and all(c.flops > 0 for c in costs)
    timed = profile(capture(NormNet().eval(), x), x.to("meta"), time=True, repeats=1, warmup=0)
    assert all(c.time is not None and c.time > 0 for c in timed)  # a meta sample stands for zeros on the CPU


class TiedLM(nn.Module):
    def __init__(self, device: str | None = None) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8, device=device)
        self.blocks = nn.Sequential(*(nn.Linear(8, 8, device=device) for _ in range(3)))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for block in self.blocks:
            h = h + torch.tanh(block(h))
        return F.linear(h, self.embed.weight)


def test_a_tied_module_keeps_the_value_of_the_first_segment_that_uses_it() -> None:
    example = torch.zeros(2, 4, dtype=torch.long, device="meta")
    chain = capture(TiedLM(device="meta"), example)
    layers = layers_of(chain)
    assert layers[-1].module.get_submodule("embed") is layers[0].module.get_submodule("embed")
    materialise_model(chain, seed=2)
    alone = capture(TiedLM(device="meta"), example)
    materialise(layers_of(alone)[0].module, 0, torch.device("cpu"), 2)
    torch.testing.assert_close(chain.embed.weight, alone.embed.weight, atol=0, rtol=0)


def test_torch_pipe_cuts_where_the_partition_does_and_leaves_the_model_alone() -> None:
    torch.manual_seed(0)
    model = UNetMLP()
    x = torch.randn(2, 16)
    chain = capture(model, x)
    part = auto(chain, 3, x, by="flops")
    pipe = torch_pipe(chain, part, (x,))
    assert pipe.num_stages == 3
    out = pipe(x)
    torch.testing.assert_close(out[0] if isinstance(out, tuple) else out, model(x))
    assert not any(m._forward_pre_hooks for m in model.modules())


class Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x) if x.sum() > 0 else -block(x)  # data-dependent control flow
        return x


class Twice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in [*self.blocks, self.blocks[0]]:
            x = block(x)
        return x


class Dropping(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        self.drop = nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.blocks(x))


def test_what_cannot_be_captured_or_cut_is_refused_with_the_reason() -> None:
    with pytest.raises(
        CaptureError,
        match=r"(?s)could not capture Branchy: GuardOnDataDependentSymNode: Could not guard .*stagewise_chain",
    ):
        capture(Branchy(), torch.randn(2, 4))
    with pytest.raises(ValueError, match=r"blocks \['blocks.0'\] run more than once per forward"):
        capture(Twice(), torch.randn(2, 4))
    with pytest.raises(ValueError, match=r"Linear has no repeated blocks .* blocks=\[...\]"):
        capture(nn.Linear(4, 4), torch.randn(2, 4))
    with pytest.raises(ValueError, match=r"blocks names 'nope', which is not a submodule"):
        capture(UNetMLP(), torch.randn(2, 16), blocks=["nope"])
    with pytest.raises(TypeError, match=r"a tensor, a tuple of tensors .* got list"):
        capture(UNetMLP(), [torch.randn(2, 16)])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"share their first \(batch\) dimension, got shapes \[\(2, 8\), \(3, 8\)\]"):
        capture(MaskedTransformer(), (torch.zeros(2, 8, dtype=torch.long), torch.ones(3, 8, dtype=torch.long)))
    clashing = UNetMLP()
    clashing.graph = nn.Linear(2, 2)  # a name the captured segments keep for themselves
    with pytest.raises(
        CaptureError, match=r"UNetMLP has attributes named \['graph'\], which capture\(\) keeps for the "
    ):
        capture(clashing, torch.randn(2, 16))
    dropping = Dropping()
    chain = capture(dropping, torch.randn(2, 4), blocks=["blocks.0", "blocks.1"])
    chain.eval()
    x = torch.randn(2, 4)
    torch.testing.assert_close(chain(x), dropping.eval()(x), atol=0, rtol=0)  # its dropout passes x through
    normed = capture(NormNet(), torch.randn(4, 4)).eval()
    with pytest.raises(RuntimeError, match=r"captured in training mode and contains dropout or batch norm"):
        normed(torch.randn(2, 4))


class Dense(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.relu(self.fc(x))


class Experts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.experts = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + (self.experts[0](x) + self.experts[1](x)) / 2


class Alternating(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Dense(), Experts(), Dense(), Experts()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def test_blocks_of_two_alternating_classes_are_cut_at_each_block() -> None:
    # Only a container whose children were all of one class counted: a list of dense and expert blocks was
    # passed over, and the chain was cut between the experts inside a block instead.
    model = Alternating()
    assert repeated_blocks(model) == ["blocks.0", "blocks.1", "blocks.2", "blocks.3"]
    x = torch.randn(2, 8)
    chain = capture(model, x)
    assert [layer.name for layer in layers_of(chain)] == ["blocks.0", "blocks.1", "blocks.2", "blocks.3"]
    torch.testing.assert_close(chain(x), model(x))
