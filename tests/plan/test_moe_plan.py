"""The planner on mixture-of-experts models: each MoE block costed by its config (the top-k active experts' FLOPs,
every expert's parameters), the experts' memory 1/ep on a rank and not sharded by FSDP, the all-to-alls within a
node or across, ep searched with the other dimensions, and a plan with ep that train reads."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from stagewise.cli import main
from stagewise.models import GPTConfig
from stagewise.models.moe import MoE, MoEConfig
from stagewise.plan import Option, evaluate, plan
from stagewise.plan.balanced_moe import balanced_routing
from stagewise.plan.cluster import Cluster, Device
from stagewise.plan.evaluate import overheads, partitioned
from stagewise.plan.plan_file import load_plan, sectioned
from stagewise.plan.planner import candidates
from stagewise.plan.rejection import Rejection
from stagewise.plan.setting import Setting, Settings
from stagewise.plan.time_model import all_to_all_seconds, ring_seconds
from stagewise.plan.workload import Workload, preset_model, workload
from stagewise.run.job import resolved

GiB = 2**30
D, E, K, H, SEQ, BATCH = 32, 4, 2, 24, 16, 2
"""The test model's width, routed experts, top-k, expert width, sequence length and profiled micro-batch."""
DENSE_HIDDEN = 4 * D
TOKENS = SEQ * BATCH
CONFIG = GPTConfig(
    vocab_size=64, seq_len=SEQ, d_model=D, n_layers=3, n_heads=2,
    moe=MoEConfig(experts=E, top_k=K, d_expert=H, shared_experts=1, dense_layers=1),
)  # fmt: skip
"""Layers: embed, blocks.0 (dense), blocks.1 and blocks.2 (MoE), norm, head."""
DENSE, MOE = 1, 2


def with_experts(experts: int) -> GPTConfig:
    """The test model with ``experts`` routed experts per MoE layer."""
    assert CONFIG.moe is not None
    return dataclasses.replace(CONFIG, moe=dataclasses.replace(CONFIG.moe, experts=experts))


def moe_workload(config: GPTConfig = CONFIG, *, global_batch: int = 16, imbalance: float = 1.0) -> Workload:
    model = config.build(device="meta")
    sample = config.example(BATCH, None)
    work = workload(model, sample, global_batch=global_batch, tokens_per_sample=SEQ)
    return dataclasses.replace(work, expert_imbalance=imbalance)


@pytest.fixture(scope="module")
def work() -> Workload:
    return moe_workload()


def cluster(n: int = 4, memory: float = 8 * GiB, per_node: int = 8) -> Cluster:
    return Cluster((Device(memory, 1e12),) * n, gpus_per_node=per_node)


def option(**fields: object) -> Option:
    base: dict[str, object] = {
        "pp": 1, "dp": 1, "n_virtual": 1, "n_microbatches": 1, "schedule": "1f1b", "activation_checkpointing": False,
    }  # fmt: skip
    base.update(fields)
    return Option(**base)  # type: ignore[arg-type]


def setting_of(work: Workload, where: Cluster, **fields: object) -> Setting:
    found = Settings(work, where).of(option(**fields))
    assert not isinstance(found, Rejection), found
    return found


# --- what an MoE block costs, by hand -------------------------------------------------------------------------


def test_an_moe_block_costs_its_active_experts_flops_and_all_experts_parameters(work: Workload) -> None:
    dense, moe = work.costs[DENSE], work.costs[MOE]
    routed = 3 * E * D * H
    assert moe.params - dense.params == D * E + routed + 3 * D * H - (
        D * DENSE_HIDDEN + DENSE_HIDDEN + DENSE_HIDDEN * D + D
    )
    # Forward matmuls beyond the shared attention: router, the top-k choices through their SwiGLU experts, the
    # shared expert; against the dense MLP. The backward is twice each.
    active = 2 * TOKENS * D * E + 2 * 3 * TOKENS * K * D * H + 2 * 3 * TOKENS * D * H
    assert moe.forward_flops - dense.forward_flops == active - 2 * 2 * TOKENS * D * DENSE_HIDDEN
    assert moe.flops - dense.flops == 3 * (active - 2 * 2 * TOKENS * D * DENSE_HIDDEN)
    expert = work.experts[MOE]
    assert expert is not None and work.experts[DENSE] is None and work.expert_counts == E
    assert (expert.params, expert.param_bytes) == (routed, 4 * routed)
    assert (expert.forward_flops, expert.flops) == (2 * 3 * TOKENS * K * D * H, 3 * 2 * 3 * TOKENS * K * D * H)
    assert expert.dispatch_bytes == TOKENS * K * D * 4
    # every choice's input and output, the gate's output, its SiLU, the up projection's and their product
    assert expert.saved_bytes == TOKENS * K * (2 * D + 4 * H) * 4


def test_more_experts_at_the_same_top_k_add_parameters_not_compute() -> None:
    wider = with_experts(2 * E)
    few, many = moe_workload().costs[MOE], moe_workload(wider).costs[MOE]
    assert many.params - few.params == E * (3 * D * H + D)
    assert many.forward_flops - few.forward_flops == 2 * TOKENS * D * E  # the router's wider output alone


def test_costing_is_deterministic_and_leaves_the_model_as_it_was() -> None:
    model = CONFIG.build(device="meta")
    sample = CONFIG.example(BATCH, None)
    first = workload(model, sample, global_batch=4)
    assert workload(model, sample, global_batch=4) == first
    assert all(type(m) is MoE and "_costing_key" not in vars(m) for m in model.modules() if isinstance(m, MoE))
    with pytest.raises(NotImplementedError):  # a real MoE cannot route meta tensors: why balanced routing exists
        model(sample)


def test_a_subclass_of_moe_is_refused() -> None:
    class Custom(MoE):
        pass

    model = CONFIG.build(device="meta")
    model.blocks[1].moe.__class__ = Custom
    with (
        pytest.raises(TypeError, match="cannot cost Custom, a subclass of MoE whose routing the planner does not know"),
        balanced_routing(model),
    ):
        pass
    assert type(model.blocks[1].moe) is Custom and type(model.blocks[2].moe) is MoE  # as it was


# --- memory per rank ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fsdp", [1, 4])
def test_experts_state_is_one_ep_th_on_a_rank_and_not_sharded_by_fsdp(work: Workload, fsdp: int) -> None:
    where = cluster()
    expert_bytes = sum(e.param_bytes for e in work.experts if e is not None)
    dense_bytes = sum(c.param_bytes for c in work.costs) - expert_bytes
    buffers = sum(c.buffer_bytes for c in work.costs)
    peaks = {}
    for ep in (1, 2, 4):
        s = setting_of(work, where, dp=4 // fsdp, fsdp=fsdp, ep=ep)
        held = s.memory.fixed_bytes(range(len(work.costs)))
        assert held == pytest.approx(dense_bytes * s.state + expert_bytes / ep * 4 + buffers)
        evaluated = evaluate(s.option, work, where)
        assert evaluated.rejected is None
        peaks[ep] = evaluated.rank_memory[0]
    # balanced (imbalance 1): the activations do not change with ep, the experts' state does
    assert peaks[1] - peaks[2] == pytest.approx(expert_bytes * 4 / 2)
    assert peaks[1] - peaks[4] == pytest.approx(expert_bytes * 4 * 3 / 4)


def test_tensor_parallelism_does_not_split_the_experts(work: Workload) -> None:
    whole, split = setting_of(work, cluster(), dp=4, ep=2), setting_of(work, cluster(), dp=2, ep=2, tp=2)
    expert = work.experts[MOE]
    assert expert is not None
    for s in (whole, split):
        assert s.layers.costs[MOE].buffer_bytes - work.costs[MOE].buffer_bytes == expert.param_bytes // 2 * 4
    dense = work.costs[MOE].flops - expert.flops
    traffic = work.traffic(2)
    assert not isinstance(traffic, str)
    ways = 2 if traffic[MOE].split else 1  # what the model's plan splits of the block (attention), not its experts
    for s, shards in ((whole, 4), (split, 2)):
        factor = work.global_batch // shards / BATCH  # each rank's micro-batch over the profiled one
        tp = s.option.tp
        expected = int(dense * factor) // (ways if tp > 1 else 1) + int(expert.flops * factor)
        assert s.layers.costs[MOE].flops == expected


def test_imbalance_multiplies_the_split_experts_compute_and_activations() -> None:
    even, skewed = moe_workload(), moe_workload(imbalance=1.5)
    expert = even.experts[MOE]
    assert expert is not None
    for ep, more in ((1, 0.0), (2, 0.5)):  # with every expert on each rank, a rank computes only its own tokens
        a, b = (setting_of(w, cluster(), dp=4, ep=ep).layers.costs[MOE] for w in (even, skewed))
        factor = even.global_batch // 4 / BATCH
        assert b.flops - a.flops == pytest.approx(expert.flops * more * factor, abs=1)
        assert b.saved_bytes - a.saved_bytes == pytest.approx(expert.saved_bytes * more * factor, abs=1)


# --- time -----------------------------------------------------------------------------------------------------


def test_all_to_all_within_a_node_and_across() -> None:
    nbytes, latency = 1e9, 20e-6
    node = cluster(per_node=8)
    assert all_to_all_seconds(nbytes, 1, 1, node) == 0.0
    within = all_to_all_seconds(nbytes, 4, 2, node)  # ep x tp = 8: one node
    assert within == pytest.approx(latency + nbytes * 3 / 4 / node.intra_node_bandwidth)
    across = all_to_all_seconds(nbytes, 4, 4, node)  # two ep ranks per node: half of it crosses
    assert across == pytest.approx(latency + nbytes * 2 / 4 / node.network_bandwidth)
    assert across > within


@pytest.mark.parametrize("per_node", [4, 2])
def test_an_moe_layer_pays_four_all_to_alls_per_micro_batch(work: Workload, per_node: int) -> None:
    where = cluster(per_node=per_node)
    one, four = setting_of(work, where, dp=4, ep=1), setting_of(work, where, dp=4, ep=4)
    micro = work.global_batch // 4  # samples per rank and micro-batch
    a2a = all_to_all_seconds(TOKENS // BATCH * micro * K * D * 4, 4, 1, where)
    (f1, b1), (f4, b4) = one.layers.seconds[MOE], four.layers.seconds[MOE]
    assert (f4 - f1, b4 - b1) == pytest.approx((2 * a2a, 2 * a2a))
    assert one.layers.seconds[DENSE] == four.layers.seconds[DENSE]
    crosses = per_node < 4
    expected = 20e-6 + TOKENS // BATCH * micro * K * D * 4 * (2 if crosses else 3) / 4 / (
        where.network_bandwidth if crosses else where.intra_node_bandwidth
    )
    assert a2a == pytest.approx(expected)


def test_the_experts_gradients_are_all_reduced_over_their_replicas(work: Workload) -> None:
    where = cluster()
    expert_bytes = sum(e.param_bytes for e in work.experts if e is not None)
    for ep, replicas in ((1, 4), (2, 2), (4, 1)):
        s = setting_of(work, where, dp=4, ep=ep)
        part = partitioned(s)
        assert not isinstance(part, Rejection)
        extra = overheads(s, part, work, where)
        expected = ring_seconds(expert_bytes / ep, replicas, where.intra_node_bandwidth, 20e-6, all_reduce=True)
        assert extra.experts == pytest.approx(expected)


# --- the search -----------------------------------------------------------------------------------------------


def test_ep_is_searched_among_the_divisors_layout_allows(work: Workload) -> None:
    found = candidates(8, len(work.costs), 16, experts=E)
    pairs = {(o.dp, o.fsdp, o.ep) for o in found if o.pp == 1 and o.tp == 1}
    assert {(8, 1, 1), (8, 1, 2), (8, 1, 4), (1, 8, 1), (1, 8, 2), (1, 8, 4)} <= pairs
    assert all(o.ep <= E and E % o.ep == 0 and (o.fsdp if o.fsdp > 1 else o.dp) % o.ep == 0 for o in found)
    assert {o.ep for o in candidates(8, len(work.costs), 16)} == {1}  # no experts: no ep


def test_ep_is_chosen_where_memory_binds(work: Workload) -> None:
    """One stage (each rank holds every layer): the experts' state is what splitting them saves."""
    one_stage = [o for o in candidates(4, len(work.costs), work.global_batch, experts=E) if o.pp == 1]
    roomy = plan(work, cluster(), options=one_stage)
    assert roomy.best is not None
    least = {ep: min(max(o.rank_memory) for o in roomy.options if o.ep == ep) for ep in (1, 2, 4)}
    assert least[4] < least[2] < least[1]
    tight = plan(work, cluster(memory=(least[1] + least[4]) / 2), options=one_stage)
    assert tight.best is not None and tight.best.ep > 1
    assert all(o.ep > 1 for o in tight.options)
    assert any(o.ep == 1 for o in tight.rejected)


def test_an_moe_model_plans_at_ep_1(work: Workload) -> None:
    every = candidates(4, len(work.costs), work.global_batch, experts=E)
    alone = plan(work, cluster(), options=[o for o in every if o.ep == 1])
    assert alone.best is not None and alone.best.ep == 1


def test_a_layout_that_cannot_take_its_ep_is_rejected(work: Workload) -> None:
    dense = dataclasses.replace(work, experts=())
    where = cluster()
    checks = [
        (work, {"dp": 2, "fsdp": 2, "ep": 4}, "ep=4 does not divide fsdp=2, whose ranks it borrows"),
        (work, {"dp": 4, "ep": 8}, "ep=8 does not divide dp=4"),
        (dense, {"dp": 4, "ep": 2}, "ep=2, but the model has no mixture-of-experts layers to split"),
    ]
    for w, fields, reason in checks:
        found = evaluate(option(**fields), w, where)
        assert found.rejected is not None and reason in found.rejected
    three = moe_workload(with_experts(3))
    found = evaluate(option(dp=4, ep=2), three, where)
    assert found.rejected == "ep=2 does not divide the 3 experts of an MoE layer"


def test_workload_refuses_a_bad_imbalance_or_expert_list(work: Workload) -> None:
    with pytest.raises(ValueError, match=r"expert_imbalance must be >= 1 and finite .* got 0.9"):
        dataclasses.replace(work, expert_imbalance=0.9)
    with pytest.raises(ValueError, match="experts describes 1 layers but costs 6"):
        dataclasses.replace(work, experts=(None,))


# --- the plan file --------------------------------------------------------------------------------------------


def test_a_plan_with_ep_round_trips_and_loads_into_train_config(tmp_path: Path) -> None:
    model, sample, _ = preset_model("gpt-moe-tiny", 1, None)
    work = workload(model, sample, global_batch=8, tokens_per_sample=128)
    every = candidates(4, len(work.costs), 8, experts=work.expert_counts)
    result = plan(work, cluster(), options=[o for o in every if o.ep == 2 and o.fsdp == 2], top=1)
    assert result.best is not None and result.best.ep == 2
    text = result.to_json(work, model="gpt-moe-tiny", seq_len=128)
    assert json.loads(text)["layout"]["ep"] == 2
    loaded = load_plan(text)
    assert sectioned(loaded) == json.loads(text) and loaded["ep"] == 2
    path = tmp_path / "plan.json"
    path.write_text(text)
    config = resolved({}, plan_file=path)
    assert (config.ep, config.fsdp, config.layout.ep) == (2, 2, 2)
    assert config.layout.expert_shape[3] == 2


def test_cli_plans_an_moe_preset_with_ep(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "plan.json"
    args = ["plan", "--model", "gpt-moe-tiny", "--gpus", "4", "--batch-size", "8", "--ep", "2", "--top", "2"]
    assert main([*args, "--expert-imbalance", "1.5", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "3 MoE layers of 8 routed experts" in printed and " ep=2 " in printed
    assert json.loads(out.read_text())["layout"]["ep"] == 2
    assert main(["plan", "--model", "gpt-tiny", "--gpus", "4", "--batch-size", "8", "--ep", "2"]) == 2
    assert "--ep 2 splits mixture-of-experts layers, but gpt-tiny has none; leave --ep out" in capsys.readouterr().err
    for value in ("0.9", "many"):
        with pytest.raises(SystemExit):
            main([*args, "--expert-imbalance", value])
        assert "--expert-imbalance: expected a ratio >= 1 such as 1.25" in capsys.readouterr().err


def test_the_bounded_search_finds_the_whole_searchs_top_with_experts() -> None:
    """The search's lower bounds hold with the experts' all-to-alls, imbalance and all-reduce: its top layouts
    are those of evaluating every candidate."""
    work = moe_workload(imbalance=1.25)
    where = cluster(per_node=2)  # ep=4 crosses a node
    full = plan(work, where)
    assert {o.ep for o in full.options} == {1, 2, 4}
    for top in (1, 3):
        pruned = plan(work, where, top=top)
        assert pruned.options == full.options[:top]
