"""profile(): FLOPs, parameters and activation bytes of real modules, on real and meta devices."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint
from torch.utils.flop_counter import FlopCounterMode

from stagewise.models import GPT, GPTConfig
from stagewise.partition import LayerCost, capture, memory_model, profile
from stagewise.partition.attention import FLOP_FORMULAS


def test_linear_flops_params_and_bytes() -> None:
    batch, fan_in, fan_out = 8, 64, 32
    model = nn.Sequential(nn.Linear(fan_in, fan_out), nn.ReLU())
    (linear, relu) = profile(model, torch.randn(batch, fan_in))
    per_pass = 2 * fan_in * fan_out * batch
    assert linear.forward_flops == per_pass
    # The data needs no gradient (a pipeline computes none): backward is the weight's gradient alone.
    assert linear.flops == 2 * per_pass
    # Behind another layer, or with a sample that asks for it, backward is two passes of the same size: gradient
    # of the input and of the weight.
    (after,) = profile(nn.Sequential(nn.Linear(fan_in, fan_out)), torch.randn(batch, fan_in, requires_grad=True))
    assert after.flops == 3 * per_pass
    assert linear.params == fan_in * fan_out + fan_out
    assert linear.param_bytes == 4 * linear.params
    assert linear.output_bytes == 4 * batch * fan_out
    # Linear keeps its input for the weight gradient; the weight itself is not an activation.
    assert linear.saved_bytes == 4 * batch * fan_in
    # ReLU keeps its output.
    assert relu.saved_bytes == 4 * batch * fan_out
    assert relu.params == 0 and relu.flops == 0
    assert linear.time is None


def _held_for_backward(layers: list[nn.Module], x: torch.Tensor) -> int:
    """Bytes of the distinct storages autograd keeps when ``layers`` run one after another, parameters excluded."""
    params = {p.untyped_storage() for layer in layers for p in layer.parameters()}
    held: dict[torch.UntypedStorage, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage not in params:
            held[storage] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        for layer in layers:
            x = layer(x)
    return sum(held.values())


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_a_stage_counts_a_tensor_two_layers_save_once(device: str) -> None:
    # ReLU and Tanh save their output, which the next Linear saves as its input: a stage holds it once.
    d = 16
    layers = [nn.Linear(d, d), nn.ReLU(), nn.Linear(d, 2 * d), nn.Tanh(), nn.Linear(2 * d, d), nn.GELU(),
              nn.LayerNorm(d), nn.Linear(d, d)]  # fmt: skip
    model = nn.Sequential(*layers).to(device)
    sample = torch.randn(4, d, device=device)
    costs = profile(model, sample)
    assert [c.shared_bytes for c in costs] == [0, 0, 4 * 4 * d, 0, 4 * 4 * 2 * d, 0, 0, 0]
    memory = memory_model(costs, 1)
    inputs = [sample]
    with torch.no_grad():
        for layer in model:
            inputs.append(layer(inputs[-1]))
    for start in range(len(layers)):
        for stop in range(start + 1, len(layers) + 1):
            x = inputs[start].detach().requires_grad_()  # as the stage receives it
            held = _held_for_backward(list(model)[start:stop], x)
            assert memory.kept(start, stop) == held, (start, stop)
    assert sum(c.saved_bytes for c in costs) > memory.kept(0, len(layers))


class TiedPair(nn.Module):
    """A linear layer, then a functional linear through its weight transposed: two reads of one weight."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.proj = nn.Linear(d, 2 * d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        out: torch.Tensor = torch.nn.functional.linear(h, self.proj.weight.t())
        return out


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_pooled_bytes_are_the_inputs_and_outputs_of_large_linears(device: str) -> None:
    batch, d = 4, 16
    model = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d), TiedPair(d)).to(device)
    sample = torch.randn(batch, d, device=device)
    # 4d x d = 1024 elements: the two linears of the MLP reach the threshold, the tied pair's weight (512) does not.
    up, gelu, down, tied = profile(model, sample, pooled_min_elements=1024)
    assert up.pooled_bytes == 4 * batch * (d + 4 * d)
    assert down.pooled_bytes == 4 * batch * (4 * d + d)
    assert (gelu.pooled_bytes, tied.pooled_bytes) == (0, 0)
    # With every weight pooled, the tied pair counts its first read only: the second reads a view of the weight,
    # which fusion leaves to autograd.
    everything = profile(model, sample, pooled_min_elements=0)
    assert everything[3].pooled_bytes == 4 * batch * (d + 2 * d)
    assert [c.pooled_bytes for c in profile(model, sample)] == [0, 0, 0, 0]  # the default threshold: 2^18 elements


class KeywordAttention(nn.Module):
    """Self-attention that passes its arguments to ``F.scaled_dot_product_attention`` by name."""

    def __init__(self, d: int, device: str) -> None:
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (z.transpose(1, 2) for z in self.qkv(x).view(b, t, 3, 2, d // 2).unbind(2))
        out = torch.nn.functional.scaled_dot_product_attention(query=q, key=k, value=v, is_causal=True)
        return out.transpose(1, 2).reshape(b, t, d)


@pytest.mark.parametrize("model", ["gpt", "captured gpt", "keyword attention"])
def test_meta_and_real_give_the_same_counts(model: str) -> None:
    # Captured graphs call aten's attention op, and a model may pass its arguments by name: meta still counts the
    # fused kernel, as the CPU runs it.
    cfg = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_layers=2, n_heads=4)
    ids = torch.randint(0, 64, (2, 16))
    if model == "keyword attention":
        x = torch.randn(2, 16, 32)
        real = profile(nn.Sequential(KeywordAttention(32, "cpu"), KeywordAttention(32, "cpu")), x)
        meta = profile(nn.Sequential(KeywordAttention(32, "meta"), KeywordAttention(32, "meta")), x)
    elif model == "captured gpt":
        real = profile(capture(GPT(cfg), ids), ids)
        meta = profile(capture(GPT(cfg, device="meta"), ids.to("meta")), ids)
    else:
        real = profile(GPT(cfg), ids)
        meta = profile(GPT(cfg, device="meta"), ids)
    for r, m in zip(real, meta, strict=True):
        assert (r.name, r.params, r.param_bytes, r.flops, r.forward_flops, r.output_bytes) == (
            m.name,
            m.params,
            m.param_bytes,
            m.flops,
            m.forward_flops,
            m.output_bytes,
        )
        # The fused attention kernel's meta version also keeps its two RNG-state scalars.
        assert r.saved_bytes <= m.saved_bytes <= r.saved_bytes + 64
    if model != "gpt":
        return
    blocks = [c for c in meta if c.name.startswith("blocks.")]
    d, t, b = 32, 16, 2
    # Attention and MLP matmuls: qkv (3d^2), proj (d^2), MLP (8d^2) per token, times 2 for multiply-add.
    dense = 2 * b * t * 12 * d * d
    attention = 2 * (2 * b * t * t * d)  # scores and weighted sum, causal mask not discounted
    assert all(c.forward_flops == dense + attention for c in blocks)
    assert all(c.params == 12 * d * d + 13 * d for c in blocks)


def test_profile_leaves_the_model_untouched() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    costs = profile(model, torch.randn(16, 4), time=True, repeats=2, warmup=1)
    assert all(p.grad is None for p in model.parameters())
    for key, value in model.state_dict().items():
        torch.testing.assert_close(value, before[key])
    assert costs[1].buffer_bytes == model[1].running_mean.numel() * 4 * 2 + 8


def test_time_is_measured_and_meta_layers_are_materialised() -> None:
    cfg = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_layers=2, n_heads=4)
    costs = profile(GPT(cfg, device="meta"), torch.randint(0, 64, (2, 16)), time=True, repeats=3, warmup=1)
    assert all(c.time is not None and c.time > 0 for c in costs)


def test_tuples_flow_between_layers() -> None:
    class Split(nn.Module):
        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return x, (x > 0)

    class Masked(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
            out: torch.Tensor = self.lin(x[0]) * x[1]
            return out

    costs = profile(nn.Sequential(Split(), Masked()), torch.randn(3, 4))
    assert costs[0].output_bytes == 3 * 4 * 4 + 3 * 4 * 1  # float hidden plus bool mask
    assert costs[1].forward_flops == 2 * 3 * 4 * 4


def test_bad_outputs_and_arguments() -> None:
    class Dict(nn.Module):
        def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
            return {"x": x}

    with pytest.raises(TypeError, match=r"the output of layer '0' must be a tensor or a tuple of tensors, got dict"):
        profile(nn.Sequential(Dict()), torch.randn(2))
    with pytest.raises(TypeError, match=r"sample must be a tensor or a tuple of tensors, got list"):
        profile(nn.Sequential(nn.ReLU()), [torch.randn(2)])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"measuring time needs a real device"):
        profile(nn.Sequential(nn.ReLU()), torch.randn(2), time=True, device="meta")
    with pytest.raises(ValueError, match=r"need warmup >= 0 and repeats >= 1, got warmup=0, repeats=0"):
        profile(nn.Sequential(nn.ReLU()), torch.randn(2), repeats=0, warmup=0)


_BIG = """
import json, resource, torch
from stagewise.models import build
from stagewise.partition import balance_costs, profile
model = build("gpt-7b", device="meta")
costs = profile(model, torch.zeros(1, 2048, dtype=torch.long))
part = balance_costs(costs, 8, by="flops", capacities=[80 * 2**30] * 8, n_microbatches=16)
print(json.dumps({"params": sum(c.params for c in costs), "flops": sum(c.flops for c in costs),
                  "bounds": part.bounds, "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
"""


@pytest.mark.timeout(180)
def test_seven_billion_parameters_on_meta_without_allocating() -> None:
    out = subprocess.run([sys.executable, "-c", _BIG], capture_output=True, text=True, check=True, timeout=170)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["params"] >= 5e9
    model_bytes = 4 * result["params"]
    # The process holds torch itself (a few hundred MB), never the 27 GB of weights.
    assert result["peak_rss"] < 2 * 2**30 < model_bytes / 10
    assert result["flops"] > 6 * result["params"] * 2048 * 0.9
    assert len(result["bounds"]) == 9 and result["bounds"][-1] == 35  # partitioned into 8 stages too


def test_layer_cost_is_a_plain_record() -> None:
    cost = LayerCost("x", 1, 4, 0, 6, 2, 4, 4, None)
    assert cost.name == "x" and cost.flops == 6


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_a_layer_that_changes_its_input_in_place_is_profiled_on_a_copy(device: str) -> None:
    # Each layer's input is a leaf that requires grad, which autograd lets nothing change in place:
    # ReLU(inplace=True), common in CNNs, made profile() and auto() fail with autograd's error.
    with torch.device(device):
        model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(inplace=True), nn.Linear(8, 2))
    costs = profile(model, torch.randn(4, 8, device=device), time=device == "cpu")
    assert [c.name for c in costs] == ["0", "1", "2"]
    assert [c.forward_flops for c in costs] == [2 * 4 * 8 * 8, 0, 2 * 4 * 8 * 2]
    assert costs[1].output_bytes == 4 * 8 * 4


class GroupedQueryAttention(nn.Module):
    """Causal attention of 8 query heads over 2 key/value heads (enable_gqa), as in Llama-style models."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.kv = nn.Linear(64, 64), nn.Linear(64, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q(x).view(b, t, 8, 8).transpose(1, 2)
        k, v = self.kv(x).view(b, t, 2, 2, 8).permute(2, 0, 3, 1, 4)
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return out.transpose(1, 2).reshape(b, t, 64)


def test_grouped_query_attention_on_meta_counts_a_fused_kernel() -> None:
    # On meta, enable_gqa fell back to the unfused math path: 18.8 times the CPU's saved bytes (the T x T
    # attention matrix) and fewer FLOPs. Now the FLOPs are the CPU's and the bytes within the repeated keys/values.
    x = torch.randn(2, 512, 64)
    (real,) = profile(nn.Sequential(GroupedQueryAttention()), x)
    with torch.device("meta"):
        model = nn.Sequential(GroupedQueryAttention())
    (meta,) = profile(model, x.to("meta"))
    assert meta.flops == real.flops and meta.forward_flops == real.forward_flops
    assert real.saved_bytes <= meta.saved_bytes < 1.5 * real.saved_bytes, (meta.saved_bytes, real.saved_bytes)


class HeadsAttention(nn.Module):
    """Causal grouped-query attention of ``heads`` query heads over ``key_heads`` and ``value_heads``."""

    def __init__(self, heads: int, key_heads: int, value_heads: int) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.heads = (heads, key_heads, value_heads)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (self.proj(x).unsqueeze(1).repeat(1, n, 1, 1) for n in self.heads)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).sum(1)


def _heads_attention(device: str, *heads: int) -> nn.Sequential:
    with torch.device(device):
        return nn.Sequential(HeadsAttention(*heads))


@pytest.mark.parametrize(("heads", "key_heads", "value_heads"), [(8, 3, 3), (2, 8, 8), (8, 2, 3)])
def test_grouped_query_attention_on_meta_refuses_the_heads_real_attention_refuses(
    heads: int, key_heads: int, value_heads: int
) -> None:
    # 8 query heads over 3 key/value heads were counted on meta as 8 // 3 = 2 groups; torch refuses them.
    x = torch.randn(2, 16, 8)
    with pytest.raises(RuntimeError, match=r"Number of heads in key and value must divide the number of heads in"):
        profile(_heads_attention("cpu", heads, key_heads, value_heads), x)
    got = rf"got {heads} query heads, {key_heads} key heads and {value_heads} value heads \(query \[2, {heads}, 16, 8\]"
    with pytest.raises(ValueError, match=rf"query's heads to be a multiple of the key's and the value's, {got}"):
        profile(_heads_attention("meta", heads, key_heads, value_heads), x.to("meta"))


def test_grouped_query_attention_on_meta_repeats_keys_and_values_each_to_the_query_heads() -> None:
    # Keys and values may have different numbers of heads, each a divisor of the query's: torch repeats each by
    # its own factor, where meta repeated both by the keys' (values of 16 heads for 8 query heads).
    x = torch.randn(2, 16, 8)
    (real,), (meta,) = profile(_heads_attention("cpu", 8, 2, 4), x), profile(_heads_attention("meta", 8, 2, 4), x)
    assert meta.forward_flops == real.forward_flops and meta.output_bytes == real.output_bytes


def test_use_bytes_count_the_outputs_whose_gradients_zero_bubbles_weight_pass_starts_from() -> None:
    # Each op that reads a parameter (linear, layer norm) keeps its output's gradient from I to W; a GELU reads none,
    # and a pooled linear's bytes are in pooled_bytes instead.
    model = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.GELU(), nn.Linear(8, 600))
    assert [c.use_bytes for c in profile(model, torch.zeros(3, 4))] == [3 * 8 * 4, 3 * 8 * 4, 0, 3 * 600 * 4]
    pooled = profile(nn.Sequential(nn.Linear(4, 8)), torch.zeros(3, 4), pooled_min_elements=32)[0]
    assert (pooled.use_bytes, pooled.pooled_bytes) == (0, 3 * 4 * 4 + 3 * 8 * 4)


def test_working_bytes_count_what_a_layers_backward_holds_for_a_moment() -> None:
    # A layer's backward holds the gradient of its output and of its input at once (its parameters' gradients are
    # counted with the parameters); the first layer's input is the data, which gets no gradient.
    model = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.GELU(), nn.Linear(8, 600))
    costs = profile(model, torch.zeros(3, 4))
    assert [c.working_bytes for c in costs] == [3 * 8 * 4, 2 * 3 * 8 * 4, 2 * 3 * 8 * 4, 3 * 600 * 4 + 3 * 8 * 4]
    assert costs == profile(model.to("meta"), torch.zeros(3, 4, device="meta"))  # the same on meta


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.nn.functional.gelu(self.fc1(x)))


@pytest.mark.parametrize("device", ["meta", "cpu"])
def test_selective_checkpointing_keeps_the_matmuls_outputs_and_recomputes_the_rest_by_their_bytes(device: str) -> None:
    # A batch of 4: fc1's output (4 x 16 floats) and fc2's (4 x 8) are kept; GELU reads 4 x 16 floats and writes
    # as many, which selective checkpointing recomputes, with no FLOPs torch counts.
    (cost,) = profile(nn.Sequential(_Block()).to(device), torch.randn(4, 8, device=device))
    assert cost.selective_bytes == 4 * 16 * 4 + 4 * 8 * 4
    assert cost.recompute_bytes == 2 * 4 * 16 * 4
    assert cost.recompute_flops == 0
    assert cost.selective_bytes < cost.saved_bytes


def _flops_torch_recomputes(layer: nn.Module, x: torch.Tensor) -> int:
    """The FLOPs torch's own checkpointing runs again in backward: a checkpointed backward's less a plain one's."""
    counts = []
    for checkpointed in (False, True):
        x = x.detach().requires_grad_()
        out = checkpoint(layer, x, use_reentrant=False) if checkpointed else layer(x)
        with FlopCounterMode(display=False, custom_mapping=FLOP_FORMULAS) as counter:  # fused attention too
            out.sum().backward()
        counts.append(counter.get_total_flops())
    return counts[1] - counts[0]


@pytest.mark.parametrize("device", ["meta", "cpu"])
def test_whole_layer_checkpointing_recomputes_up_to_the_last_saved_tensor_as_torch_does(device: str) -> None:
    # fc2 saves its input (GELU's output) before it multiplies, and torch stops recomputing there: fc1's matmul
    # runs again, fc2's does not.
    block = _Block().to(device)
    x = torch.randn(4, 8, device=device)
    (cost,) = profile(nn.Sequential(block), x)
    assert cost.checkpoint_flops == 2 * 4 * 8 * 16
    assert cost.checkpoint_flops == _flops_torch_recomputes(block, x)
    config = GPTConfig(vocab_size=64, seq_len=32, d_model=32, n_heads=4, n_layers=1)
    gpt_block = GPT(config).blocks[0].to(device)
    h = torch.randn(2, 32, 32, device=device)
    (block_cost,) = profile(nn.Sequential(gpt_block), h)
    assert block_cost.checkpoint_flops == _flops_torch_recomputes(gpt_block, h)
    assert 0 < block_cost.checkpoint_flops < block_cost.forward_flops
