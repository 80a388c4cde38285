"""The mixture-of-experts layer on its own: routing by hand, capacity, the balance loss and its invariance to how the
batch is cut, the routing bias, and refused configurations."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from stagewise.models import GPTConfig
from stagewise.models.moe import MoE, MoEConfig, auxiliary_loss, balance_experts, moe_layers


def layer(config: MoEConfig, d: int = 16, hidden: int = 8) -> MoE:
    torch.manual_seed(0)
    return MoE(config, d, hidden)


def by_hand(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """Each token through each of its top-k experts, one at a time, weighted; plus the shared experts."""
    c = moe.config
    flat = x.reshape(-1, x.shape[-1])
    scores = moe.router(flat).softmax(-1) if c.scoring == "softmax" else moe.router(flat).sigmoid()
    out = torch.zeros_like(flat)
    for t in range(flat.shape[0]):
        top = scores[t].topk(c.top_k).indices
        weights = scores[t][top]
        if c.top_k > 1 or c.scoring == "sigmoid":
            weights = weights / weights.sum()
        for w, e in zip(weights, top.tolist(), strict=True):
            g, u, dn = moe.experts.gate[e], moe.experts.up[e], moe.experts.down[e]
            out[t] += w * ((F.silu(flat[t] @ g) * (flat[t] @ u)) @ dn)
    out = out.reshape_as(x)
    return out + moe.shared(x) if moe.shared is not None else out


@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
@pytest.mark.parametrize("top_k", [1, 2])
def test_dropless_routing_sends_every_token_to_its_top_k_experts(scoring: str, top_k: int) -> None:
    moe = layer(MoEConfig(experts=4, top_k=top_k, scoring=scoring, shared_experts=1))  # type: ignore[arg-type]
    x = torch.randn(3, 5, 16)
    torch.testing.assert_close(moe(x), by_hand(moe, x), atol=1e-5, rtol=1e-5)


def test_capacity_keeps_each_experts_first_tokens_of_each_sequence() -> None:
    config = MoEConfig(experts=4, top_k=1, capacity_factor=1.0, balancing="none")
    moe = layer(config)
    x = torch.randn(2, 8, 16)
    routing = moe.route(x.reshape(-1, 16), 8)
    capacity = math.ceil(1.0 * 8 * 1 / 4)
    for row in range(2):
        chosen = routing.chosen.reshape(2, 8)[row].tolist()
        kept = routing.experts.reshape(2, 8)[row].tolist()
        seen: dict[int, int] = {}
        for want, got in zip(chosen, kept, strict=True):
            seen[want] = seen.get(want, 0) + 1
            assert got == (want if seen[want] <= capacity else config.experts)
    assert (routing.experts == config.experts).any(), "the random routing overflowed no expert: the test tests less"
    # A dropped choice adds nothing: the output of a token whose only choice was dropped is zero.
    dropped = (routing.experts == config.experts).reshape(-1)
    assert moe(x).reshape(-1, 16)[dropped].abs().max() == 0


def test_the_balance_loss_is_the_mean_over_sequences_of_f_times_p() -> None:
    config = MoEConfig(experts=4, top_k=2, aux_loss_coefficient=0.5)
    moe = layer(config)
    x = torch.randn(3, 6, 16)
    routing = moe.route(x.reshape(-1, 16), 6)
    want = 0.0
    for row in range(3):
        chosen = routing.chosen.reshape(3, 6, 2)[row]
        f = torch.bincount(chosen.reshape(-1), minlength=4).float() * 4 / (2 * 6)
        p = routing.probabilities.reshape(3, 6, 4)[row].mean(0)
        want += 0.5 * float((f * p).sum().detach())
    assert float(moe.balance_loss(routing, 3)) == pytest.approx(want, rel=1e-6)


def test_losses_and_gradients_do_not_depend_on_how_the_batch_is_cut() -> None:
    """The property the pipeline relies on: micro-batches that each know the batch's rows give the whole batch's
    loss (with the balance loss) and gradients."""
    config = GPTConfig(
        vocab_size=64, seq_len=8, d_model=32, n_layers=2, n_heads=2,
        moe=MoEConfig(experts=4, top_k=2, shared_experts=1, aux_loss_coefficient=0.1),
    )  # fmt: skip
    torch.manual_seed(1)
    model = config.build()
    ids = torch.randint(0, 64, (4, 8))
    whole = config.loss(model(ids), ids)
    whole.backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    want_loss = float(whole) + float(auxiliary_loss(model))
    model.zero_grad()
    for moe in moe_layers(model):
        moe.batch_rows = 4
    total = 0.0
    for part in ids.split(1):
        loss = config.loss(model(part), part) / 4
        loss.backward()
        total += float(loss)
    total += float(sum(m.take_auxiliary_loss().total for m in moe_layers(model))) / 4
    assert total == pytest.approx(want_loss, rel=1e-6)
    assert float(auxiliary_loss(model)) == 0  # taken
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, want[name], atol=1e-6, rtol=1e-5, msg=name)
    router = model.blocks[0].moe.router.weight  # type: ignore[union-attr]
    assert want["blocks.0.moe.router.weight"].abs().sum() > 0 and router.grad is not None


def test_the_routing_bias_chooses_experts_but_does_not_weigh_them_and_moves_towards_balance() -> None:
    config = MoEConfig(experts=4, top_k=1, balancing="bias", bias_rate=0.5)
    moe = layer(config)
    x = torch.randn(2, 8, 16)
    before = moe.route(x.reshape(-1, 16), 8)
    moe.expert_bias.copy_(torch.tensor([0.0, 0.0, 0.0, 10.0]))
    biased = moe.route(x.reshape(-1, 16), 8)
    assert (biased.chosen == 3).all()  # the bias decides the choice ...
    # ... not the weight: expert 3's routing probability (top-1, softmax: not renormalised)
    torch.testing.assert_close(biased.weights, before.probabilities[:, 3:])
    torch.testing.assert_close(biased.probabilities, before.probabilities)
    moe.expert_bias.zero_()
    moe.train()
    with torch.enable_grad():
        moe(x)
    load = torch.bincount(before.chosen.reshape(-1), minlength=4).double()
    model = torch.nn.Sequential(moe)
    balance_experts(model)
    want = torch.sign(load.mean() - load) * 0.5
    torch.testing.assert_close(moe.expert_bias, want.float())
    assert float(moe.take_load().sum()) == 0  # the load was taken


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"experts": 0}, "MoEConfig.experts must be >= 1, got 0"),
        ({"experts": 4, "top_k": 5}, "MoEConfig.top_k=5 exceeds experts=4; choose at most 4"),
        ({"capacity_factor": -1.0}, "MoEConfig.capacity_factor must be >= 0 (0: dropless), got -1.0"),
        ({"scoring": "relu"}, "MoEConfig.scoring must be 'softmax' or 'sigmoid', got 'relu'"),
        ({"balancing": "loss"}, "MoEConfig.balancing must be 'aux-loss', 'bias' or 'none', got 'loss'"),
    ],
)
def test_a_bad_configuration_is_refused_in_one_line(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError) as err:
        MoEConfig(**kwargs)  # type: ignore[arg-type]
    assert str(err.value) == message


def test_more_dense_layers_than_blocks_is_refused() -> None:
    with pytest.raises(ValueError, match=r"MoEConfig.dense_layers=5 exceeds the 4 blocks; choose at most 4"):
        GPTConfig(n_layers=4, moe=MoEConfig(dense_layers=5))
