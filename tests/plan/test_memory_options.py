"""The planner's memory options priced on hand-computed small cases: selective and whole-layer checkpointing,
FSDP gathering per micro-batch, optimizer and activation offloading; the V schedules and looped BFS searched with
their memory per rank; the plan file and the command line carrying them."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from stagewise.cli import main
from stagewise.partition import LayerCost
from stagewise.plan import Option, evaluate, plan
from stagewise.plan.cluster import Cluster, Device
from stagewise.plan.evaluate import stage_costs
from stagewise.plan.option import Checkpointing
from stagewise.plan.plan_file import load_plan, sectioned
from stagewise.plan.planner import candidates
from stagewise.plan.time_model import ring_seconds
from stagewise.plan.workload import Workload
from stagewise.schedule import build, peak_in_flight

GiB = 2**30
MiB = 2**20
BANDWIDTH = 2e12
"""The devices' memory bandwidth (Device's default): selective recomputation's bytes move at it."""


def layers(n: int = 4) -> tuple[LayerCost, ...]:
    """``n`` layers of 1 GiB of parameters, 1 s forward and 2 s backward at 1e12 FLOP/s, saving 1 GiB of which
    selective keeps 0.5 GiB and recomputes ops moving 0.1 s of bytes."""
    return tuple(
        LayerCost(
            name=f"l{i}",
            params=GiB // 4,
            param_bytes=GiB,
            buffer_bytes=0,
            flops=3 * 10**12,
            forward_flops=10**12,
            output_bytes=MiB,
            saved_bytes=GiB,
            time=None,
            selective_bytes=GiB // 2,
            recompute_flops=0,
            recompute_bytes=int(0.1 * BANDWIDTH),
        )
        for i in range(n)
    )


def work(global_batch: int = 1) -> Workload:
    return Workload(costs=layers(), profiled_batch=1, global_batch=global_batch, input_bytes=MiB)


def cluster(n: int, **host: float | bool) -> Cluster:
    return Cluster((Device(1024 * GiB, 1e12),) * n, **host)  # type: ignore[arg-type]


def test_selective_checkpointing_sits_between_none_and_whole_layers_in_memory_and_time() -> None:
    found = {
        ckpt: evaluate(Option(1, 1, 1, 1, "1f1b", ckpt), work(), cluster(1)) for ckpt in (False, "selective", True)
    }
    none, selective, whole = found[False], found["selective"], found[True]
    # Four layers: 1 s forward, 2 s backward each; whole layers recompute 1 s each, selective 0.1 s (bytes).
    assert whole.step_time - none.step_time == pytest.approx(4 * 1.0)
    assert selective.step_time - none.step_time == pytest.approx(4 * 0.1)
    # Saved: 1 GiB a layer; selective its input and 0.5 GiB, plus one layer's 0.5 GiB recomputed at once; whole
    # layers their inputs, plus one layer's 1 GiB recomputed. The last layer's 1 MiB output is held until the
    # backward (selective keeps it already) with the loss's output-sized tensor.
    assert none.rank_activation[0] == pytest.approx(4 * GiB + 2 * MiB, rel=1e-6)
    assert selective.rank_activation[0] == pytest.approx(4 * (GiB / 2 + MiB) + GiB / 2 + MiB, rel=1e-6)
    assert whole.rank_activation[0] == pytest.approx(4 * MiB + GiB + 2 * MiB, rel=1e-6)


def test_a_split_backward_recomputes_in_i_and_again_in_w() -> None:
    cases: tuple[tuple[Checkpointing, float], ...] = ((False, 0.0), (True, 1.0), ("selective", 0.1))
    for ckpt, again in cases:
        option = evaluate(Option(2, 1, 1, 2, "zero-bubble", ckpt), work(2), cluster(2))
        assert option.rejected is None, option.rejected
        costs = stage_costs(option, work(2), cluster(2))
        # Two layers a stage: backward 2 s each, split in halves; the recomputation in each of I and W, and a
        # checkpointed W passes the gradient through the whole layer again.
        assert costs.input_grad[0] == pytest.approx(2 * (1.0 + again))
        assert costs.weight_grad[0] == pytest.approx(2 * ((2.0 if ckpt else 1.0) + again))
        assert costs.backward[0] == pytest.approx(2 * (2.0 + again))


def _sharded(gather: str, **settings: float | bool) -> Option:
    # pp=2 ranks of fsdp=2 shards, two stages a rank (interleaved): one layer a stage, 2 GiB of parameters a rank.
    option = Option(2, 1, 2, 2, "interleaved-1f1b", False, fsdp=2, fsdp_gather=gather)  # type: ignore[arg-type]
    return evaluate(option, work(4), cluster(4, **settings))


def test_gathering_per_micro_batch_holds_the_shards_and_one_stage_whole_and_hides_the_step_gathers() -> None:
    step, each = _sharded("step"), _sharded("micro-batch")
    fixed = [m - a for m, a in zip(step.rank_memory, step.rank_activation, strict=True)]
    fixed_each = [m - a for m, a in zip(each.rank_memory, each.rank_activation, strict=True)]
    # Weights and Adam's moments sharded over 2 (1.5 GiB a layer; zero_grad left no gradients), plus the whole
    # parameters and gradients of both stages (2 a layer), against the sharded gradients too (0.5 a layer, 2 GiB
    # a rank) and one stage whole: amid the activations its parameters and the gradients its backward makes (2
    # GiB), or after a backward its reduce-scatter too (3 GiB) with that micro-batch's 1 GiB freed.
    assert fixed == pytest.approx([2 * (1.5 + 2) * GiB] * 2)
    assert fixed_each == pytest.approx([2 * 2 * GiB + 2 * GiB] * 2)
    # Once a step: an all-gather and a reduce-scatter of a rank's 2 GiB; per action they hide under 1 s of compute.
    gather = ring_seconds(2 * GiB, 2, 300e9, 20e-6, all_reduce=False)
    assert step.step_time - each.step_time == pytest.approx(2 * gather, rel=1e-6)
    # Without a side stream (gloo) each action waits for its gathers: slower than once a step.
    assert _sharded("micro-batch", side_stream=False).step_time > _sharded("step", side_stream=False).step_time


HOST = {"host_memory": 4096 * GiB, "host_bandwidth": 25e9}


def test_offloading_the_optimizer_moves_its_state_to_the_host_and_steps_there() -> None:
    kept = evaluate(Option(1, 1, 1, 1, "1f1b", False), work(), cluster(1, **HOST))
    moved = evaluate(Option(1, 1, 1, 1, "1f1b", False, offload_optimizer=True), work(), cluster(1, **HOST))
    # 4 GiB of parameters: Adam's 16 GiB on the device, or the whole weights and gradients (8 GiB) with the
    # shard's state (16 GiB) on the host.
    assert kept.rank_memory[0] - kept.rank_activation[0] == pytest.approx(16 * GiB)
    assert moved.rank_memory[0] - moved.rank_activation[0] == pytest.approx(8 * GiB)
    assert moved.rank_host_memory == pytest.approx((16 * GiB,)) and kept.rank_host_memory == ()
    # Gradients to the host and parameters back at 25e9 B/s, and the state read and written three times by the
    # host at its 50e9 B/s per node over 8 GPUs.
    host_step = 2 * 4 * GiB / 25e9 + 4 * GiB * 4 * 3 / (50e9 / 8)
    device_step = 4 * GiB * 4 * 3 / BANDWIDTH
    assert moved.step_time - kept.step_time == pytest.approx(host_step - device_step)


def test_offloading_activations_keeps_two_micro_batches_on_the_device_and_costs_what_the_link_adds() -> None:
    base = Option(1, 1, 1, 4, "gpipe", False)
    kept = evaluate(base, work(4), cluster(1, **HOST))
    moved = evaluate(dataclasses.replace(base, offload_activations=True), work(4), cluster(1, **HOST))
    # Each micro-batch: 4 GiB saved, the loss's output-sized tensor and the output the pipeline holds (1 MiB each).
    assert kept.rank_activation[0] == pytest.approx(4 * (4 * GiB + 2 * MiB), rel=1e-6)
    assert moved.rank_activation[0] == pytest.approx(2 * (4 * GiB + 2 * MiB), rel=1e-6)
    assert moved.rank_host_memory[0] == pytest.approx(4 * (4 * GiB + 2 * MiB), rel=1e-6)
    # 1 GiB a layer each way at 25e9 B/s: 43 ms, hidden under 1 s of forward and 2 s of backward.
    assert moved.step_time == pytest.approx(kept.step_time)
    slow = evaluate(dataclasses.replace(base, offload_activations=True), work(4), cluster(1, **{**HOST,
                    "host_bandwidth": 0.5e9}))  # fmt: skip
    # 2.15 s a layer at 0.5e9 B/s: forward waits 1.15 s for it, backward 0.15 s, per layer and micro-batch (the
    # last layer also keeps an output-sized 1 MiB tensor for the loss, and the 1 MiB output, counted with it).
    exposed = 16 * (GiB / 0.5e9 - 1 + GiB / 0.5e9 - 2) + 4 * 2 * 2 * MiB / 0.5e9
    assert slow.step_time - kept.step_time == pytest.approx(exposed, rel=1e-6)
    small = evaluate(dataclasses.replace(base, offload_activations=True), work(4), cluster(1, **{**HOST,
                     "host_memory": 64 * GiB}))  # fmt: skip
    assert small.rejected == (
        "rank 0 offloads 16.0 GiB to the host > 8.0 GiB (its share of 64 GiB per node over 8 GPUs)"
    )


@pytest.mark.parametrize("name", ["looped-bfs", "zbv", "dualpipev"])
def test_the_v_schedules_and_looped_bfs_are_searched_with_their_memory_per_rank(name: str) -> None:
    options = [o for o in candidates(2, 4, 4) if o.schedule == name and o.n_microbatches == 4]
    assert options and all(o.n_virtual == 2 for o in options)
    found = evaluate(Option(2, 1, 2, 4, name, False), work(4), cluster(2))  # type: ignore[arg-type]
    assert found.rejected is None and found.partition is not None
    assert found.partition.bounds == (0, 1, 2, 3, 4)
    schedule = build(name, 4, 4, n_virtual=2)  # type: ignore[arg-type]
    peaks = peak_in_flight(schedule)
    for rank in range(2):
        mine = schedule.stages_of(rank)  # the V: stages r and 3 - r; looped BFS: r and r + 2
        assert mine == ((rank, 3 - rank) if name != "looped-bfs" else (rank, rank + 2))
        # Each stage one layer of 1 GiB in flight per micro-batch (and the last its 1 MiB output), at least.
        least = sum(peaks[s] for s in mine) * GiB
        assert found.rank_activation[rank] >= least
        assert found.rank_memory[rank] - found.rank_activation[rank] == pytest.approx(2 * 4 * GiB)
    result = plan(work(4), cluster(2), top=3)
    assert result.best is not None


def test_the_plan_file_carries_the_memory_options(tmp_path: Path) -> None:
    option = _sharded("micro-batch")
    chosen = dataclasses.replace(option, activation_checkpointing="selective", offload_optimizer=True,
                                 offload_activations=True, rank_host_memory=(1.0, 2.0))  # fmt: skip
    from stagewise.plan.option import Plan

    text = Plan((chosen,), (), None).to_json(work(4), model="gpt-tiny", seq_len=None)
    data = json.loads(text)
    assert data["layout"]["fsdp_gather"] == "micro-batch" and data["layout"]["offload_optimizer"] is True
    assert data["compute"] == {"activation_checkpointing": "selective", "offload_activations": True}
    assert data["predicted"]["rank_host_memory"] == [1.0, 2.0]
    assert sectioned(load_plan(text)) == data


def test_the_host_settings_are_checked() -> None:
    with pytest.raises(ValueError, match=r"host_memory is given but host_bandwidth is not; offloading needs both"):
        Cluster((Device(GiB, 1e12),), host_memory=GiB)
    with pytest.raises(ValueError, match=r"host_bandwidth must be positive and finite, or None \(no offloading\)"):
        Cluster((Device(GiB, 1e12),), host_memory=GiB, host_bandwidth=-1.0)


def test_the_host_flags_are_parsed_and_refused_clearly(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", "--model", "gpt-tiny", "--gpus", "2", "--gpu-memory", "1GiB", "--batch-size", "8",
            "--seq-len", "32"]  # fmt: skip
    for extra, error in (
        (["--host-memory", "2TiB"], "--host-memory is given without --host-bandwidth; offloading to the host needs"),
        (["--host-bandwidth", "25e9"], "--host-bandwidth is given without --host-memory"),
    ):
        assert main([*argv, *extra]) == 2
        assert error in capsys.readouterr().err
    for extra, error in (
        (["--host-bandwidth", "fast"], "--host-bandwidth: expected bytes per second such as 25e9, got 'fast'"),
        (["--host-bandwidth", "0"], "--host-bandwidth: expected bytes per second above 0 such as 25e9, got '0'"),
        (["--host-memory", "0GiB"], "--host-memory: "),
    ):
        with pytest.raises(SystemExit):
            main([*argv, *extra, "--host-memory" if "--host-memory" not in extra else "--host-bandwidth",
                  "2TiB" if "--host-memory" not in extra else "25e9"])  # fmt: skip
        assert error in capsys.readouterr().err
    assert main([*argv, "--host-memory", "64GiB", "--host-bandwidth", "25e9"]) == 0
    assert "+offload-opt optimizer on the host" in capsys.readouterr().out
