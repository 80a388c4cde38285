"""plan(): layouts that fit, ranked by simulated step time; clear answers when nothing fits; mixed devices."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import get_args

import pytest
import torch
import torch.nn.functional as F
from support.multiproc import run_ranks
from torch import nn

from stagewise.cli import main, parser
from stagewise.cli.train import config_of
from stagewise.models import build, preset
from stagewise.partition import LayerCost, Partition
from stagewise.partition.live_bytes import LiveBytes
from stagewise.plan import Option, evaluate, plan
from stagewise.plan.cluster import Cluster, Device, parse_devices
from stagewise.plan.evaluate import partitioned
from stagewise.plan.measure import measure_optimizer
from stagewise.plan.plan_file import load_plan
from stagewise.plan.planner import SEARCHED, candidates
from stagewise.plan.rejection import Rejection
from stagewise.plan.setting import Setting, Settings
from stagewise.plan.synthesised import synthesised
from stagewise.plan.workload import PASSES_ALLOWED, Workload, _profile_rank, workload
from stagewise.run import TrainConfig, train
from stagewise.run.job_pipeline import schedule_of
from stagewise.schedule import Schedule, ScheduleName, peak_in_flight, validate
from stagewise.schedule import build as build_schedule
from stagewise.schedule.builders import BUILDERS

GiB = 2**30


def gpt_workload(name: str, batch: int, seq: int) -> Workload:
    config = preset(name)
    return workload(config.build(device="meta"), config.example(1, seq), global_batch=batch, tokens_per_sample=seq)


@pytest.fixture(scope="module")
def seventy() -> Workload:
    return gpt_workload("gpt-70b", 512, 4096)


def test_seventy_billion_on_64_gpus_fits_and_never_exceeds_memory(seventy: Workload) -> None:
    cluster = Cluster((Device(80 * GiB, 400e12),) * 64)
    # What `stagewise plan` shows (--top 8), most layouts ruled out by bounds.
    top = plan(seventy, cluster, top=8)
    assert len(top.unranked) > len(top.rejected)
    best = top.options[0]
    assert (best.describe(), round(best.step_time, 2)) == (
        "pp=8 dp=1 fsdp=4 tp=2 m=128 interleaved-1f1b +ckpt +gather/mb",
        52.11,
    )
    # Every layout of 8 ranks of fsdp=4 x tp=2 evaluated (every layout takes minutes): the same 8 fastest as the search.
    every = [o for o in candidates(64, 83, 512, tp_degrees=(2,)) if o.pp == 8 and o.tp == 2 and o.fsdp == 4]
    result = plan(seventy, cluster, options=every)
    assert result.best is not None and result.smallest_memory is None
    for option in result.options:
        assert max(option.rank_memory) <= 80 * GiB, option.describe()
        assert option.partition is not None and option.partition.n_stages == option.pp * option.n_virtual
    times = [o.step_time for o in result.options]
    assert times == sorted(times)
    reasons = [o.rejected for o in result.rejected]
    assert any(r and "GiB > 40.0 GiB (in the leanest split)" in r for r in reasons)
    assert plan(seventy, cluster, options=every, top=8).options == result.options[:8]


def test_a_model_that_cannot_fit_says_how_much_memory_it_needs(seventy: Workload) -> None:
    small = Cluster((Device(16 * GiB, 100e12),) * 4)
    result = plan(seventy, small)
    assert result.best is None and result.options == ()
    assert result.smallest_memory is not None and result.smallest_memory > 16 * GiB
    # 70e9 parameters with Adam's 16 bytes each cannot go below their share of 4 devices.
    assert result.smallest_memory >= 70e9 * 16 / 4


def test_a_rejection_names_the_stage_that_overflows_its_own_device() -> None:
    # Four 1 GiB layers, each saving 1 GiB per micro-batch in flight, on a 100 GiB and a 5 GiB device:
    # the large stage 0 has room to spare, while stage 1 cannot hold even one layer's 5 GiB.
    costs = tuple(
        LayerCost(name=f"l{i}", params=GiB // 4, param_bytes=GiB, buffer_bytes=0, flops=10**12,
                  forward_flops=10**12 // 3, output_bytes=1024, saved_bytes=GiB, time=None)
        for i in range(4)
    )  # fmt: skip
    work = Workload(costs=costs, profiled_batch=1, global_batch=4, input_bytes=1024)
    cluster = Cluster((Device(100 * GiB, 1e14), Device(5 * GiB, 1e14)))
    option = evaluate(Option(2, 1, 1, 4, "1f1b", False), work, cluster)
    # The last layer also holds the loss's output-sized tensor and the output itself (1 KiB each).
    assert option.rejected == "stage 1 needs 5.000002 GiB > 5.000000 GiB (in the leanest split)"
    assert option.rank_memory == (5 * GiB + 2048,)  # stage 1 with its one layer, not stage 0 with three (12 GiB)
    # Interleaved, each device holds two stages: a rejection against half a device's memory says why it is half.
    interleaved = evaluate(Option(2, 1, 2, 4, "interleaved-1f1b", False), work, cluster)
    assert interleaved.rejected is not None and interleaved.rejected.endswith(
        "; each device holds 2 stages of the interleaved schedule, so a stage gets 1/2 of it"
    ), interleaved.rejected


def test_a_refusal_is_one_typed_result_with_the_memory_it_would_need() -> None:
    # The setting of a layout and its partition each come back as a Rejection where they cannot be had, never as a
    # string or an Option standing in for one.
    costs = tuple(
        LayerCost(name=f"l{i}", params=GiB // 4, param_bytes=GiB, buffer_bytes=0, flops=10**12,
                  forward_flops=10**12 // 3, output_bytes=1024, saved_bytes=GiB, time=None)
        for i in range(4)
    )  # fmt: skip
    work = Workload(costs=costs, profiled_batch=1, global_batch=4, input_bytes=1024)
    settings = Settings(work, Cluster((Device(100 * GiB, 1e14), Device(5 * GiB, 1e14))))
    assert settings.of(Option(2, 1, 1, 3, "1f1b", False)) == Rejection("batch 4 per replica not divisible by m=3")
    setting = settings.of(Option(2, 1, 1, 4, "1f1b", False))
    assert isinstance(setting, Setting)
    assert partitioned(setting) == Rejection(
        "stage 1 needs 5.000002 GiB > 5.000000 GiB (in the leanest split)", rank_memory=(5 * GiB + 2048,)
    )


def test_mixed_devices_shape_the_partition() -> None:
    work = gpt_workload("gpt-small", 16, 256)
    same = evaluate(Option(2, 1, 1, 4, "1f1b", False), work, Cluster((Device(80 * GiB, 100e12),) * 2))
    mixed = evaluate(
        Option(2, 1, 1, 4, "1f1b", False), work, Cluster((Device(80 * GiB, 100e12), Device(80 * GiB, 300e12)))
    )
    assert same.partition is not None and mixed.partition is not None
    # The second device is 3x faster, so it gets more of the model and the step gets shorter.
    assert mixed.partition.bounds[1] < same.partition.bounds[1]
    assert mixed.step_time < same.step_time
    assert parse_devices("2x80GiB@1e14,1x40GiB@3e13")[2] == Device(40 * GiB, 3e13)
    # Described in rank order: groups that are not neighbours stay apart.
    sandwich = Cluster(parse_devices("2x80GiB@1e14,1x40GiB@3e13,2x80GiB@1e14"))
    assert sandwich.describe() == (
        "2 x 80.00 GiB at 1e+14 FLOP/s, 1 x 40.00 GiB at 3e+13 FLOP/s, 2 x 80.00 GiB at 1e+14 FLOP/s"
    )
    slow = Cluster((Device(GiB, 1e12), Device(GiB, 1e12, memory_bandwidth=1e11)))
    assert slow.describe().endswith("1 x 1.00 GiB at 1e+12 FLOP/s and 93.13 GiB/s")
    with pytest.raises(ValueError, match=r"cannot read the device group '2x80GiB'; write COUNTxMEMORY@FLOPS"):
        parse_devices("2x80GiB")
    with pytest.raises(ValueError, match=r"cannot read the FLOP/s '1.2.3' of the device group '2x80GiB@1.2.3'"):
        parse_devices("2x80GiB@1.2.3")
    with pytest.raises(ValueError, match=r"a device's flops must be positive and finite, got inf"):
        parse_devices("2x80GiB@1e400")
    with pytest.raises(ValueError, match=r"link_latency must be >= 0 and finite, got nan"):
        Cluster((Device(GiB, 1e12),), link_latency=float("nan"))


def test_workloads_refuse_bad_counts_and_time_the_optimizer_they_plan_for() -> None:
    work = gpt_workload("gpt-tiny", 8, 32)
    for field, value in (("global_batch", 0), ("tokens_per_sample", 0), ("state_multiplier", float("inf"))):
        with pytest.raises(ValueError, match=rf"{field} must be .*got {value}"):
            dataclasses.replace(work, **{field: value})
    # AdamW reads and writes four tensors per parameter, SGD with momentum three: it is the faster step.
    adamw, sgd = (measure_optimizer(torch.device("cpu"), kind=k, params=1 << 20) for k in ("adamw", "sgd"))
    assert sgd < adamw
    # A model with real weights has its loss timed too (its output's shape comes from a meta copy).
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
    target = torch.randn(2, 4)
    real = workload(model, torch.randn(2, 8), global_batch=8, measure_on="cpu", loss=(F.mse_loss, target))
    assert real.loss_seconds[0] > 0 and real.loss_seconds[1] > 0


def test_counts_are_whole_numbers_refused_in_one_line_with_the_fix() -> None:
    work = gpt_workload("gpt-tiny", 8, 32)
    with pytest.raises(TypeError, match=r"^global_batch must be a whole number, got True; give the samples of one "):
        dataclasses.replace(work, global_batch=True)
    with pytest.raises(ValueError, match=r"^gpus_per_node must be >= 1, got 0; give the devices of one node"):
        Cluster((Device(GiB, 1e12),), gpus_per_node=0)
    with pytest.raises(TypeError, match=r"^gpus_per_node must be a whole number, got 8.0; give the devices of one "):
        Cluster((Device(GiB, 1e12),), gpus_per_node=8.0)  # type: ignore[arg-type]


def test_one_stage_has_no_bubble_and_bad_layouts_are_named() -> None:
    work = gpt_workload("gpt-tiny", 12, 64)
    cluster = Cluster((Device(8 * GiB, 1e12),) * 2)
    one = evaluate(Option(1, 2, 1, 2, "1f1b", False), work, cluster)
    assert one.rejected is None and one.bubble == pytest.approx(0.0)
    assert evaluate(Option(2, 1, 1, 5, "1f1b", False), work, cluster).rejected == (
        "batch 12 per replica not divisible by m=5"
    )
    three = Cluster((Device(8 * GiB, 1e12),) * 3)
    assert evaluate(Option(1, 3, 1, 1, "1f1b", False), gpt_workload("gpt-tiny", 10, 64), three).rejected == (
        "global batch 10 not divisible by dp=3"
    )


def test_a_stage_counts_a_tied_weight_once() -> None:
    """The tied embedding and head on one stage hold one copy: parameters and memory as the model's."""
    work = gpt_workload("gpt-tiny-tied", 4, 64)
    model = preset("gpt-tiny-tied").build(device="meta")
    unique = sum(p.numel() * p.element_size() for p in model.parameters())
    assert len(work.shared) == 1 and sum(c.param_bytes for c in work.costs) > unique
    buffers = sum(c.buffer_bytes for c in work.costs)
    cluster = Cluster((Device(8 * GiB, 1e12),))
    one = evaluate(Option(1, 1, 1, 1, "1f1b", False), work, cluster)
    assert one.rejected is None
    assert one.rank_memory[0] - one.rank_activation[0] == 4 * unique + buffers
    two = evaluate(Option(2, 1, 1, 2, "1f1b", False), work, Cluster((Device(8 * GiB, 1e12),) * 2))
    assert two.partition is not None
    # On two stages each keeps its own copy of the tied weight, so together they hold one more than the model.
    tied = work.shared[0].nbytes
    held = [m - a for m, a in zip(two.rank_memory, two.rank_activation, strict=True)]
    assert sum(held) == 4 * (unique + tied) + buffers


def test_a_rank_holding_both_ends_of_a_tie_in_two_stages_counts_it_once() -> None:
    # Interleaved, pp=2 x v=2: rank 0 holds stages 0 and 2, whose linears share one weight; Pipeline keeps one
    # copy per rank (it reties across the rank's stages), so the rank's parameter state counts it once.
    model = nn.Sequential(nn.Linear(256, 256, bias=False), nn.Tanh(), nn.Linear(256, 256, bias=False), nn.Tanh())
    model[2].weight = model[0].weight
    work = workload(model, torch.randn(4, 256), global_batch=8)
    option = evaluate(Option(2, 1, 2, 2, "interleaved-1f1b", False), work, Cluster((Device(GiB, 1e12),) * 2))
    assert option.partition is not None and option.partition.bounds == (0, 1, 2, 3, 4)
    # Its activations are a few KiB: rank 0 is fullest while AdamW steps, with the weight, its gradient and two
    # moments, and two temporary copies of its largest tensor, the tied weight, counted once (twice: 12 copies).
    assert option.rank_memory[0] == 6 * 256 * 256 * 4
    assert option.rank_memory[1] - option.rank_activation[1] == 0


def test_ranks_that_share_fewer_cores_are_predicted_slower_and_enough_cores_change_nothing(tmp_path: Path) -> None:
    # FLOP-costed (one process a core): 4 data-parallel ranks on 2 cores compute at half speed all step.
    steps = {}
    for cores in (None, 2, 4):
        out = tmp_path / f"{cores}.json"
        argv = ["plan", "--model", "gpt-tiny", "--gpus", "4", "--gpus-per-node", "4", "--batch-size", "16",
                "--fsdp", "1", "--tp", "1", "--top", "1", "--json", str(out)]  # fmt: skip
        assert main([*argv, *([] if cores is None else ["--host-cores", str(cores)])]) == 0
        chosen = json.loads(out.read_text())
        assert chosen["layout"]["dp"] == 4
        steps[cores] = chosen["predicted"]["step_time"]
    assert steps[4] == steps[None] < steps[2]
    assert main(["plan", "--model", "gpt-tiny", "--gpus", "8", "--gpus-per-node", "4", "--host-cores", "2"]) == 2


def test_plan_command_writes_a_plan_that_train_reads(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "plan.json"
    argv = ["plan", "--model", "gpt-tiny", "--gpus", "2", "--gpu-memory", "1GiB", "--batch-size", "8"]
    assert main([*argv, "--seq-len", "32", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "best: " in text and "peak memory per rank" in text
    chosen = load_plan(out.read_text())
    assert chosen["pp"] * chosen["dp"] == 2 and chosen["seq_len"] == 32
    assert main(["plan", "--model", "gpt-70b", "--gpus", "2", "--gpu-memory", "8GiB", "--batch-size", "2"]) == 1
    assert "no layout fits 2 devices; it would need at least" in capsys.readouterr().out
    for extra, error in (
        (["--model", "mlp-tiny", "--seq-len", "32"], "--seq-len applies to the GPT presets; mlp-tiny takes no seq"),
        (["--input-shape", "3x32x32"], "--input-shape applies to MODULE:FACTORY models; gpt-tiny knows its input"),
        (["--profile-ranks", "2"], "--profile-ranks says how --profile measures; add --profile, or leave"),
        (["--device", "cpu"], "--device says how --profile measures; add --profile, or leave --device out"),
        (["--devices", "2x1GiB@1e12"], "--devices lists every device; --gpus, --gpu-memory describe uniform ones"),
    ):
        assert main([*argv, *extra]) == 2  # each refused, not ignored
        assert error in capsys.readouterr().err
    broken = tmp_path / "broken.json"
    broken.write_text(json.dumps({"model": {"model": "gpt-tiny"}}))
    assert main(["train", "--plan", str(broken)]) == 2
    assert "the plan lacks ['pp', 'dp'" in capsys.readouterr().err


def test_plan_synthesise_writes_a_schedule_for_the_stages_that_train_takes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "plan.json"
    argv = ["plan", "--model", "gpt-tiny", "--gpus", "2", "--gpu-memory", "4GiB", "--batch-size", "8",
            "--seq-len", "32", "--json", str(out), "--synthesise"]  # fmt: skip
    assert main(argv) == 0
    text = capsys.readouterr().out
    line = re.search(r"synthesised for these stages: pipeline (\S+) s against (\S+)'s (\S+) s \((\S+)x\)", text)
    assert line is not None and float(line[1]) < float(line[3]), text
    chosen = load_plan(out.read_text())
    schedule = Schedule.from_text(chosen["schedule_text"])
    validate(schedule)
    assert (schedule.n_ranks, schedule.n_microbatches) == (chosen["pp"], chosen["microbatches"])
    assert max(peak_in_flight(schedule)) <= max(
        peak_in_flight(build_schedule(chosen["schedule"], 2, schedule.n_microbatches))
    )
    config = config_of(parser().parse_args(["train", "--plan", str(out)]))
    assert config.schedule_text == chosen["schedule_text"] and schedule_of(config).ranks == schedule.ranks  # type: ignore[union-attr]


def test_schedules_are_synthesised_within_the_memory_of_checkpointed_and_interleaved_layouts() -> None:
    work = gpt_workload("gpt-small", 16, 256)
    cluster = Cluster((Device(80 * GiB, 100e12),) * 2)
    for option in (Option(2, 1, 1, 4, "1f1b", True), Option(2, 1, 1, 4, "1f1b", "selective")):
        checkpointed = synthesised(evaluate(option, work, cluster), work, cluster)
        assert not isinstance(checkpointed, str) and max(peak_in_flight(checkpointed.schedule)) <= 2
    option = evaluate(Option(2, 1, 2, 4, "interleaved-1f1b", False), work, cluster)
    interleaved = synthesised(option, work, cluster)
    assert not isinstance(interleaved, str)
    own = peak_in_flight(build_schedule("interleaved-1f1b", 4, 4, n_virtual=2))
    for rank in range(2):  # each stage within the fewest its rank's stages held under interleaved 1F1B
        mine = interleaved.schedule.stages_of(rank)
        assert max(peak_in_flight(interleaved.schedule)[s] for s in mine) <= min(own[s] for s in (rank, rank + 2))
    plain = synthesised(evaluate(Option(2, 1, 1, 4, "1f1b", False), work, cluster), work, cluster)
    assert not isinstance(plain, str) and max(peak_in_flight(plain.schedule)) <= 2


def test_candidates_try_every_checkpointing_under_every_schedule() -> None:
    # Whole-layer and selective checkpointing under a split backward too (I recomputes, and W again).
    options = candidates(8, 24, 64)
    for name in ("zero-bubble", "zbv", "dualpipev", "1f1b"):
        assert {o.activation_checkpointing for o in options if o.schedule == name} == {False, True, "selective"}
    # No host described: nothing offloaded; FSDP gathers per micro-batch only over several stages per rank.
    assert not any(o.offload_optimizer or o.offload_activations for o in options)
    gathered = [o for o in options if o.fsdp_gather == "micro-batch"]
    assert gathered and all(o.fsdp > 1 and o.n_virtual == 2 for o in gathered)
    hosted = candidates(8, 24, 64, host=True)
    assert any(o.offload_optimizer for o in hosted) and any(o.offload_activations for o in hosted)
    assert not any(o.offload_activations and o.activation_checkpointing is True for o in hosted)


def test_candidates_try_every_searched_schedule_as_its_builder_says() -> None:
    # Each schedule of SEARCHED is tried, the virtual ones with two stages per rank (the interleaved one with a
    # multiple of pp micro-batches, DualPipeV with at least 2 pp), each shape one its builder takes.
    options = candidates(8, 24, 64)
    assert {o.schedule for o in options} == set(SEARCHED) == set(get_args(ScheduleName))
    for o in options:
        assert o.n_virtual == (2 if BUILDERS[o.schedule].virtual else 1), o
        assert o.schedule != "interleaved-1f1b" or o.n_microbatches % o.pp == 0, o
        assert o.schedule != "dualpipev" or o.n_microbatches >= 2 * o.pp, o
        build_schedule(o.schedule, o.pp * o.n_virtual, o.n_microbatches, n_virtual=o.n_virtual)
        assert o.pp > 1 or o.schedule == "1f1b", o  # one stage: one schedule


def test_a_plan_counts_sgds_momentum_and_train_takes_its_optimizer(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    peaks, held = {}, {}
    for optimizer in ("adamw", "sgd"):
        out = tmp_path / f"{optimizer}.json"
        argv = ["plan", "--model", "gpt-tiny", "--gpus", "1", "--gpu-memory", "1GiB", "--batch-size", "8"]
        assert main([*argv, "--seq-len", "32", "--optimizer", optimizer, "--json", str(out)]) == 0
        chosen = load_plan(out.read_text())
        assert chosen["optimizer"] == optimizer
        predicted = chosen["predicted"]
        peaks[optimizer] = predicted["rank_memory"][0]
        held[optimizer] = predicted["rank_memory"][0] - predicted["rank_activation"][0]
    param_bytes = 4 * sum(p.numel() for p in build("gpt-tiny", device="meta").parameters())
    # SGD with momentum (train's) keeps weights, gradients and momentum, and steps in place. AdamW keeps two
    # moments, and its step's temporaries (one copy of every parameter at least) on top, the activations gone:
    # this small model's fullest moment, at least 2 copies above SGD's state.
    assert peaks["adamw"] - held["sgd"] >= 2 * param_bytes
    assert config_of(parser().parse_args(["train", "--plan", str(tmp_path / "sgd.json")])).optimizer == "sgd"
    capsys.readouterr()
    assert main(["train", "--plan", str(tmp_path / "sgd.json"), "--pp", "7", "--schedule", "gpipe"]) == 2
    err = capsys.readouterr().err
    assert "--plan sets the layout, but --pp 7 (the plan's: 1), --schedule gpipe (the plan's: 1f1b) asks " in err
    # A flag given with its default value clashed too, but was taken for "not given": --optimizer adamw trained
    # with the plan's SGD.
    assert main(["train", "--plan", str(tmp_path / "sgd.json"), "--optimizer", "adamw", "--pp", "2"]) == 2
    err = capsys.readouterr().err
    assert "--pp 2 (the plan's: 1), --optimizer adamw (the plan's: sgd) asks for another" in err
    assert config_of(parser().parse_args(["train", "--plan", str(tmp_path / "sgd.json"), "--optimizer", "sgd"]))


def small_mlp() -> nn.Sequential:
    """A model for ``plan --model test_planner:small_mlp``: it takes samples of 4 features."""
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def test_plan_of_a_factory_model_refuses_an_input_shape_it_cannot_take(capsys: pytest.CaptureFixture[str]) -> None:
    # A shape the model could not take ended in a RuntimeError traceback from profiling, a bad one in int()'s.
    argv = ["plan", "--model", "test_planner:small_mlp", "--gpus", "2", "--batch-size", "8"]
    assert main([*argv, "--input-shape", "4"]) == 0
    capsys.readouterr()
    assert main([*argv, "--input-shape", "5"]) == 2
    err = capsys.readouterr().err
    assert "test_planner:small_mlp cannot take a micro-batch of shape [1, 5] (float32): " in err
    assert err.rstrip().endswith("give --input-shape as the shape of one sample the model takes")
    for shape in ("0", "-3", "4xy"):
        assert main([*argv, "--input-shape", shape]) == 2
        assert f"--input-shape {shape} is not one sample's shape: give sizes >= 1" in capsys.readouterr().err


class _DataGate(nn.Module):
    """Passes its input on only where the data says so: ``.item()`` or ``torch.nonzero`` cannot run on meta."""

    def __init__(self, op: str) -> None:
        super().__init__()
        self.op = op

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.op == "item":
            return x if x.abs().sum().item() >= 0 else -x
        return x * (torch.nonzero(x).shape[0] >= 0)


def gated_mlp() -> nn.Sequential:
    """``plan --model test_planner:gated_mlp``: samples of 4 features, a forward that calls ``.item()``."""
    return nn.Sequential(nn.Linear(4, 8), _DataGate("item"), nn.Linear(8, 2))


def masked_mlp() -> nn.Sequential:
    """``plan --model test_planner:masked_mlp``: samples of 4 features, a forward that calls ``torch.nonzero``."""
    return nn.Sequential(nn.Linear(4, 8), _DataGate("nonzero"), nn.Linear(8, 2))


@pytest.mark.parametrize(
    ("factory", "meta_error"),
    [
        ("gated_mlp", "Tensor.item() cannot be called on meta tensors"),  # a RuntimeError
        ("masked_mlp", "The register_meta function for torch.nonzero() raises unimplemented"),  # NotImplementedError
    ],
)
def test_plan_of_a_model_that_reads_its_data_checks_the_input_shape_on_the_profiled_device(
    capsys: pytest.CaptureFixture[str], factory: str, meta_error: str
) -> None:
    # The meta device cannot run .item() or nonzero: the shape check refused a right shape, which --profile plans.
    argv = ["plan", "--model", f"test_planner:{factory}", "--gpus", "2", "--batch-size", "8", "--profile"]
    assert main([*argv, "--input-shape", "4"]) == 0, capsys.readouterr().err
    capsys.readouterr()
    assert main([*argv, "--input-shape", "5"]) == 2  # a wrong one is still refused, with the CPU's reason
    err = capsys.readouterr().err
    assert f"{factory} cannot take a micro-batch of shape [1, 5] (float32): mat1 and mat2 shapes " in err
    assert "cannot be multiplied (1x5 and 4x8) (layer '0' on cpu)" in err
    assert err.rstrip().endswith("give --input-shape as the shape of one sample the model takes")
    # Without --profile the plan runs on meta, where this model cannot: say so, not that the shape is wrong.
    assert main(["plan", "--model", f"test_planner:{factory}", "--gpus", "2", "--input-shape", "4"]) == 2
    err = capsys.readouterr().err
    assert f"{factory} takes a micro-batch of shape [1, 4] (float32) on the CPU, but its layer '1' cannot run " in err
    assert f"on the meta device: {meta_error}" in err and "; its forward reads the data" in err
    assert err.rstrip().endswith("add --profile to plan the model on a real device (--device)")
    assert main(["plan", "--model", f"test_planner:{factory}", "--gpus", "2", "--input-shape", "5"]) == 2
    assert f"{factory} cannot take a micro-batch of shape [1, 5] (float32): mat1 and mat2" in capsys.readouterr().err


def live_peak(config: TrainConfig) -> int:
    """The most bytes of tensors alive at once on this rank while it trains ``config`` (LiveBytes)."""
    torch.set_num_threads(1)
    with LiveBytes() as live:
        train(config)
    torch.distributed.destroy_process_group()
    return live.peak


@pytest.mark.parametrize(
    ("stages", "schedule", "within"), [(1, "1f1b", 0.025), (2, "1f1b", 0.075), (2, "zero-bubble", 0.1)]
)
def test_each_rank_needs_the_memory_the_planner_predicts(stages: int, schedule: str, within: float) -> None:
    # Weights, gradients, AdamW's moments, the activations of the micro-batches in flight, and what one micro-batch
    # holds for a moment: the loss's tensors (the logits, their log-softmax and the gradients of both) or a layer's
    # backward. The planner counted one of the loss's four logits-sized tensors and no layer's backward: 6 % short
    # for one gpt-tiny stage (44 % for gpt-small on the H200), 11 % for 1F1B's first stage. Zero-bubble keeps each
    # micro-batch until its W, and from I to W the gradients W starts from: the planner took 1F1B's in flight, 56 %
    # short. It comes out 2 % over on one stage (a block's backward counted where the loss's is the peak) and up to
    # 7.5 % short on two (the stage's output and the transfer buffers are left out). On one host the transport's
    # shared memory stages each message in flight in a segment of the sender's (one activation or gradient here,
    # about 1 MiB): 1F1B's two stages came out 1.02 and 1.04 over gloo, 1.04 and 1.07 over shared memory.
    config = preset("gpt-tiny")
    model, sample, loss = config.build(device="meta"), config.example(8, 128), (config.loss, config.target(8, 128))
    work = workload(model, sample, global_batch=32, tokens_per_sample=128, loss=loss)  # type: ignore[arg-type]
    option = evaluate(Option(stages, 1, 1, 4, schedule, False), work, Cluster((Device(GiB, 1e12),) * stages))  # type: ignore[arg-type]
    assert option.partition is not None
    run = TrainConfig(
        model="gpt-tiny", pp=stages, schedule=schedule, microbatches=4, batch_size=32, seq_len=128,  # type: ignore[arg-type]
        steps=2, eval_every=0, checkpoint_dir=None, partition=option.partition.bounds, timeout=60,
    )  # fmt: skip
    peaks = run_ranks(live_peak, stages, run, timeout=120)
    for rank in range(stages):
        assert option.rank_memory[rank] == pytest.approx(peaks[rank], rel=within), rank


def test_the_last_stage_holds_the_losss_working_tensors() -> None:
    # A loss that holds 1 GiB per sample at its fullest (what LiveBytes counts on meta), on one 4 GiB device: one
    # micro-batch of 4 samples cannot run it; four of 1 sample fit, and the rank's memory counts it.
    costs = tuple(
        LayerCost(name=f"l{i}", params=1, param_bytes=4, buffer_bytes=0, flops=10**6, forward_flops=10**6 // 3,
                  output_bytes=1024, saved_bytes=1024, time=None)
        for i in range(2)
    )  # fmt: skip
    # Its measured bytes include the output (1 KiB) and an output-sized saved tensor, both counted as held.
    work = Workload(costs=costs, profiled_batch=1, global_batch=4, input_bytes=1024, loss_bytes=GiB + 2048)
    cluster = Cluster((Device(4 * GiB, 1e14),))
    whole = evaluate(Option(1, 1, 1, 1, "1f1b", False), work, cluster)
    assert whole.rejected == "the loss on one micro-batch needs 4.0 GiB >= 4.0 GiB on the last stage"
    split = evaluate(Option(1, 1, 1, 4, "1f1b", False), work, cluster)
    assert split.rejected is None
    unknown = evaluate(Option(1, 1, 1, 4, "1f1b", False), dataclasses.replace(work, loss_bytes=None), cluster)
    assert split.rank_memory[0] - unknown.rank_memory[0] == GiB  # what the loss holds beyond the output it reads


def test_a_partition_file_given_as_a_plan_says_what_it_is() -> None:
    # `stagewise partition --json plan.json`, then `train --plan plan.json`: "the plan lacks ['model', ...]".
    with pytest.raises(
        ValueError, match=r"this is a partition \(stagewise partition --json: the stage bounds \[0, 2, 4\]"
    ):
        load_plan(Partition.from_bounds((0, 2, 4)).to_json())


def test_fsdp_and_tensor_parallelism_divide_what_a_rank_holds() -> None:
    work = gpt_workload("gpt-small", 32, 128)
    cluster = Cluster((Device(80 * GiB, 1e14),) * 4)
    plain = evaluate(Option(1, 4, 1, 4, "1f1b", False), work, cluster)
    sharded = evaluate(Option(1, 1, 1, 4, "1f1b", False, fsdp=4), work, cluster)
    split = evaluate(Option(1, 1, 1, 4, "1f1b", False, tp=4), work, cluster)
    assert plain.rejected is None and sharded.rejected is None and split.rejected is None
    params = sum(c.param_bytes for c in work.costs) - work.shared[0].nbytes  # the tie once
    # Weights, gradients and AdamW's two moments amid the activations; or, fuller here, while AdamW steps with its
    # temporaries (one more copy of every parameter, more than two of its largest layer), the activations gone.
    assert plain.rank_memory[0] == pytest.approx(max(4 * params + plain.rank_activation[0], 5 * params), rel=1e-6)
    # FSDP: 1/4 of the weights and AdamW's moments (zero_grad left no gradients), and the whole weights and
    # gradients amid the activations; or, as the step ends, the sharded gradients and the reduce-scatter's input too.
    amid = (2 + 3 / 4) * params + sharded.rank_activation[0]
    assert sharded.rank_memory[0] == pytest.approx(max(amid, (3 + 3 / 4) * params), rel=1e-6)
    # Tensor parallelism splits every layer of a GPT but the position table and the norms (under 1 %).
    shard = params / 4
    assert split.rank_memory[0] == pytest.approx(max(4 * shard + split.rank_activation[0], 5 * shard), rel=0.01)
    # Micro-batches of 2 samples each way: a split block keeps a quarter of the activations it would (the rest is
    # the residual stream and the norms', whole on every rank), the embedding's output and the logits whole.
    same_size = evaluate(Option(1, 1, 1, 16, "1f1b", False, tp=4), work, cluster)
    assert 0.4 * plain.rank_activation[0] < same_size.rank_activation[0] < 0.75 * plain.rank_activation[0]
    assert "tp=4" in split.describe() and "fsdp=4" in sharded.describe()


def test_tensor_parallelism_stays_in_a_node_and_within_the_plan() -> None:
    work = gpt_workload("gpt-tiny", 32, 128)  # 4 heads
    cluster = Cluster((Device(80 * GiB, 1e14),) * 16, gpus_per_node=4)
    crossing = evaluate(Option(1, 2, 1, 4, "1f1b", False, tp=8), work, cluster)
    assert crossing.rejected == "tp=8 does not divide the 4 GPUs of a node: its group would cross one"
    wide = evaluate(Option(1, 2, 1, 4, "1f1b", False, tp=8), work, dataclasses.replace(cluster, gpus_per_node=8))
    assert wide.rejected is not None and wide.rejected.startswith("tp=8 does not divide the 4 attention heads")
    tps = {o.tp for o in candidates(16, 7, 32, tp_degrees=(2, 4, 8), gpus_per_node=4)}
    assert tps == {1, 2, 4}  # 8 would cross a node
    mlp = workload(*build_mlp(), global_batch=8)
    assert evaluate(Option(1, 1, 1, 1, "1f1b", False, tp=2), mlp, cluster).rejected == (
        "tp=2: the model has no tensor-parallel plan (GPT presets have one)"
    )


def build_mlp() -> tuple[nn.Module, torch.Tensor]:
    return build("mlp-tiny", device="meta"), torch.zeros(2, 32)


def test_the_plan_of_a_sharded_layout_reaches_train(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "plan.json"
    argv = ["plan", "--model", "gpt-tiny", "--gpus", "4", "--batch-size", "16", "--fsdp", "2", "--tp", "2"]
    assert main([*argv, "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "fsdp=2 tp=2" in text
    chosen = load_plan(out.read_text())
    assert (chosen["fsdp"], chosen["tp"]) == (2, 2)
    config = config_of(parser().parse_args(["train", "--plan", str(out)]))
    assert (config.pp, config.dp, config.fsdp, config.tp) == (chosen["pp"], chosen["dp"], 2, 2)
    assert main(["plan", "--model", "gpt-tiny", "--gpus", "4", "--tp", "3"]) == 2
    assert "tp=3 does not divide" in capsys.readouterr().err


def tiny_built() -> tuple[nn.Module, torch.Tensor, None]:
    return nn.Sequential(nn.Linear(8, 8), nn.Tanh()), torch.randn(2, 8), None


def test_a_rank_waiting_for_the_profile_gives_up_after_its_timeout_naming_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The other ranks of `plan --profile --profile-ranks N` waited for rank 0's flag file without a bound.
    monkeypatch.setenv("RANK", "1")
    flag = tmp_path / "done"
    threads = torch.get_num_threads()
    try:
        with pytest.raises(TimeoutError) as info:
            _profile_rank(tiny_built, (), {"measure_on": "cpu"}, str(flag), timeout=0.2)
        assert re.fullmatch(
            rf"rank 1 waited \S+ s for rank 0 to finish profiling and make {re.escape(str(flag))}, longer than the "
            rf"timeout of 0\.2 s plus {PASSES_ALLOWED} of this rank's profiling passes \(\S+ s each\); rank 0 is "
            "stuck or gone",
            str(info.value),
        ), str(info.value)
        flag.touch()
        assert _profile_rank(tiny_built, (), {"measure_on": "cpu"}, str(flag), timeout=0.2) is None
        with pytest.raises(ValueError, match="timeout must be a positive, finite number of seconds, got 0"):
            _profile_rank(tiny_built, (), {"measure_on": "cpu"}, str(flag), timeout=0)
    finally:
        torch.set_num_threads(threads)
