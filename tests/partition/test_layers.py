"""layers_of(): chains recognised, names kept, non-chains refused, tied weights found."""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch
from torch import nn

from stagewise.models import GPT, GPTConfig
from stagewise.partition import Layer, layers_of, shared_parameters


def run_chain(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    for layer in layers_of(model):
        x = layer.module(x)
    return x


def test_sequential_in_order() -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    layers = layers_of(model)
    assert [layer.name for layer in layers] == ["0", "1", "2"]
    assert [layer.module for layer in layers] == list(model)


def test_nested_sequential_flattened_only_when_asked() -> None:
    inner = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
    model = nn.Sequential(nn.Linear(4, 4), inner, nn.Linear(4, 1))
    assert [layer.name for layer in layers_of(model)] == ["0", "1", "2"]
    assert [layer.name for layer in layers_of(model, flatten=True)] == ["0", "1.0", "1.1", "2"]
    x = torch.randn(3, 4)
    torch.testing.assert_close(run_chain(model, x), model(x))


def test_named_sequential_and_module_dict_and_list() -> None:
    from collections import OrderedDict

    seq = nn.Sequential(OrderedDict(first=nn.Linear(2, 2), second=nn.Linear(2, 2)))
    assert [layer.name for layer in layers_of(seq)] == ["first", "second"]
    table = nn.ModuleDict({"a": nn.Linear(2, 2), "b": nn.ReLU()})
    assert [layer.name for layer in layers_of(table)] == ["a", "b"]
    blocks = nn.ModuleList([nn.Linear(2, 2) for _ in range(3)])
    assert [layer.name for layer in layers_of(blocks)] == ["0", "1", "2"]


def test_declared_chain_of_a_gpt_matches_its_forward() -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=32, seq_len=8, d_model=16, n_layers=3, n_heads=2))
    names = [layer.name for layer in layers_of(model)]
    assert names == ["embed", "blocks.0", "blocks.1", "blocks.2", "norm", "head"]
    ids = torch.randint(0, 32, (2, 8))
    torch.testing.assert_close(run_chain(model, ids), model(ids))
    # Layer names are the unsplit model's parameter prefixes.
    full = dict(model.named_parameters())
    for layer in layers_of(model):
        for pname, param in layer.module.named_parameters():
            assert full[f"{layer.name}.{pname}"] is param


class Pair(nn.Module):
    """Passes a tuple (hidden, mask) on, as a transformer block with a mask would."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, mask = x
        return self.lin(hidden) * mask, mask


def test_layers_may_pass_tuples() -> None:
    model = nn.Sequential(Pair(), Pair())
    x = (torch.randn(2, 4), torch.ones(2, 1))
    out = x
    for layer in layers_of(model):
        out = layer.module(out)
    torch.testing.assert_close(out, model(x))


class NotAChain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(2, 2)
        self.b = nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.a(x) + self.b(x)
        return out


def test_not_a_chain_is_a_type_error_pointing_the_way() -> None:
    with pytest.raises(
        TypeError,
        match=r"NotAChain is not a chain of layers.*'stagewise_chain'.*stagewise\.partition\.capture\(model, example\)",
    ):
        layers_of(NotAChain())
    with pytest.raises(TypeError, match=r"expects an nn.Module, got list"):
        layers_of([nn.Linear(2, 2)])  # type: ignore[arg-type]


def test_empty_model() -> None:
    with pytest.raises(ValueError, match=r"Sequential has no layers to split"):
        layers_of(nn.Sequential())


def test_declared_chain_errors() -> None:
    class Missing(NotAChain):
        stagewise_chain = ("a", "c")

    class Partial(NotAChain):
        stagewise_chain = ("a",)

    class Twice(NotAChain):
        stagewise_chain = ("a", "b", "a")

    class Bad(NotAChain):
        stagewise_chain = "ab"

    with pytest.raises(TypeError, match=r"names 'c', which is not a submodule"):
        layers_of(Missing())
    with pytest.raises(ValueError, match=r"leaves out parameters \['b.weight', 'b.bias'\]"):
        layers_of(Partial())
    with pytest.raises(ValueError, match=r"lists these layers more than once: \['a'\]"):
        layers_of(Twice())
    with pytest.raises(TypeError, match=r"must be a sequence of submodule names, got 'ab'"):
        layers_of(Bad())


def test_tied_weights_are_detected_and_named() -> None:
    embed = nn.Embedding(10, 4)
    head = nn.Linear(4, 10, bias=False)
    head.weight = embed.weight
    model = nn.Sequential(embed, nn.Linear(4, 4), head)
    assert [layer.name for layer in layers_of(model)] == ["0", "1", "2"]  # tied weights are allowed
    assert shared_parameters([Layer("0", embed), Layer("1", model[1])]) == []
    found = shared_parameters(layers_of(model))
    assert len(found) == 1
    assert found[0].layers == ("0", "2") and found[0].names == ("0.weight", "2.weight")
    assert found[0].indices == (0, 2) and found[0].attributes == ("weight", "weight")
    assert found[0].numel == 40 and found[0].nbytes == 160


def test_a_module_run_at_two_places_of_a_chain_is_listed_at_both_or_refused() -> None:
    # named_children() lists a module once however often a container holds it, so nn.Sequential(lin, act, lin)
    # gave two layers, and the pipeline trained a model without the second lin.
    act = nn.ReLU()
    chain = nn.Sequential(nn.Linear(2, 2), act, nn.Linear(2, 2), act)  # a stateless module may recur
    assert [layer.name for layer in layers_of(chain)] == ["0", "1", "2", "3"]
    assert layers_of(chain)[3].module is act
    lin = nn.Linear(2, 2)
    with pytest.raises(ValueError, match=r"Sequential runs the same Linear as layers '0' and '2'; .* tie its param"):
        layers_of(nn.Sequential(lin, act, lin))
    with pytest.raises(ValueError, match=r"runs the same BatchNorm1d as layers 'a' and 'c'"):
        norm = nn.BatchNorm1d(2, affine=False)  # buffers only
        layers_of(nn.Sequential(OrderedDict(a=norm, b=act, c=norm)))
    tied = nn.Linear(2, 2)
    tied.weight, tied.bias = lin.weight, lin.bias  # the way to share the weights
    assert [layer.name for layer in layers_of(nn.Sequential(lin, act, tied))] == ["0", "1", "2"]
