"""The command line: `partition` prints the optimal split, `train` runs the main job, and bad values are refused."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from stagewise.cli import main, parser, run_report
from stagewise.cli import train as cli_train
from stagewise.cli.train import config_of
from stagewise.partition import Partition
from stagewise.pipeline import FullySharded, PipelineOptions, SelectiveCheckpointing
from stagewise.plan.plan_file import sectioned
from stagewise.run import Summary, TrainConfig, launching
from stagewise.run.job_pipeline import pipeline_options
from stagewise.schedule import Schedule


def test_partition_prints_the_plan(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    out_file = tmp_path / "plan.json"
    assert main(["partition", "--model", "gpt-tiny", "--stages", "3", "--json", str(out_file)]) == 0
    out = capsys.readouterr().out
    assert "gpt-tiny: 7 layers" in out
    assert "embed .. " in out and ".. head" in out
    part = Partition.from_json(out_file.read_text())
    assert part.n_stages == 3 and part.n_layers == 7
    assert part.names is not None and part.names[0] == "embed"


def test_partition_by_time_with_capacity(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["partition", "--model", "gpt-tiny", "--stages", "2", "--by", "time", "--capacity", "1GiB"])
    assert code == 0
    assert "balanced by time" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--stages", "9"], "cannot split 7 layers into 9 non-empty stages"),
        (["--capacity", "6MiB"], "no split of 7 layers into 4 stages fits the capacities"),
        (["--capacity", "1KiB"], "alone needs"),
        (["--speeds", "1,2,3"], "--speeds has 3 values for 4 stages"),
        (["--seq-len", "4096"], "a sequence length of 4096 exceeds the model's longest, 128"),
        (["--device", "cpu"], "--device says where --by time measures; add --by time, or leave --device out"),
        (["--model", "mlp-tiny", "--seq-len", "64"], "--seq-len applies to the GPT presets; mlp-tiny takes no"),
    ],
)
def test_bad_values_give_exit_2_and_a_message(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["partition", "--model", "gpt-tiny", *argv]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv",
    [["--stages", "0"], ["--stages", "x"], ["--model", "nope"], ["--capacity", "lots"], ["--by", "vibes"]],
)
def test_invalid_arguments_are_refused_by_the_parser(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["partition", *argv])
    assert info.value.code == 2
    assert "error:" in capsys.readouterr().err


def test_checkpoints_every_n_steps_and_none_at_all_are_refused_together(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "--no-checkpoints", "--checkpoint-every", "4"]) == 2
    assert "--checkpoint-every 4 saves checkpoints, but --no-checkpoints writes none" in capsys.readouterr().err


def test_a_device_the_parser_cannot_use_says_why(capsys: pytest.CaptureFixture[str]) -> None:
    for argv, error in (
        (["partition", "--by", "time", "--device", "foo"], "'foo' is not a device; use cpu, cuda or cuda:N"),
        (["plan", "--profile", "--device", "foo"], "'foo' is not a device; use cpu, cuda or cuda:N"),
    ):
        with pytest.raises(SystemExit):
            main(argv)
        assert error in capsys.readouterr().err
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit):
            main(["partition", "--by", "time", "--device", "cuda"])
        assert "cuda is not available here" in capsys.readouterr().err


def test_a_schedule_file_refuses_the_built_in_shape_flags(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "mine.txt"
    path.write_text("rank 0: 0F0 1F0 1B0 0B0\n")
    assert main(["schedule", "--file", str(path)]) == 0
    capsys.readouterr()
    assert main(["schedule", "--file", str(path), "--stages", "4", "--virtual", "2"]) == 2
    err = capsys.readouterr().err
    assert "--stages, --virtual shape a built-in schedule; a --file schedule has its own" in err


def test_a_size_the_parser_cannot_read_says_how_to_write_one(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["partition", "--capacity", "80GiB,10XB"], ["plan", "--gpu-memory", "10XB"]):
        with pytest.raises(SystemExit):
            main(argv)
        assert "cannot read '10XB' as a size; write a number with an optional unit" in capsys.readouterr().err


def test_module_entry_point() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "stagewise", "partition", "--model", "gpt-tiny", "--stages", "2"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert "bottleneck" in out.stdout


def test_schedule_prints_the_simulation(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    picture, trace = tmp_path / "zb.png", tmp_path / "zb.json"
    argv = ["schedule", "zero-bubble", "--input-grad", "1", "--weight-grad", "1", "--trace", str(trace), "--text"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "rank 0: 0F0 0F1 0F2 0F3 0I0" in out
    assert "step time 27, bubble 11.1%" in out
    assert "peak micro-batches in flight per stage: 7 6 5 4" in out  # each held until its W
    assert trace.exists()
    assert main(["schedule", "1f1b", "--picture", str(picture)]) == 0
    assert picture.read_bytes().startswith(b"\x89PNG")


def test_schedule_from_a_file(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = tmp_path / "mine.txt"
    path.write_text("rank 0: 0F0 0F1 0B0 0B1\nrank 1: 1F0 1B0 1F1 1B1\n")
    assert main(["schedule", "--file", str(path)]) == 0
    assert "mine: 2 stages on 2 ranks, 2 micro-batches: valid" in capsys.readouterr().out
    path.write_text("rank 0: 0F0 0B0 0F1 0B1\nrank 1: 1F0 1F1 1B0 1B1\n")
    assert main(["schedule", "--file", str(path)]) == 2
    assert "deadlock" in capsys.readouterr().err


def test_schedule_auto_builds_for_per_stage_times_and_saves_what_loads(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    saved = tmp_path / "auto.txt"
    times = ["--forward", "0.6,1,1,1.8", "--input-grad", "0.6,1,1,1.8", "--weight-grad", "0.5,0.8,0.8,1.4"]
    assert main(["schedule", "auto", "--stages", "4", *times, "--limit", "4", "--save", str(saved)]) == 0
    out = capsys.readouterr().out
    assert "best built-in within the limit: 1f1b, step 47.3 (1.110x)" in out
    assert "synthesised (round robin, I/W): 4 stages on 4 ranks, 8 micro-batches: valid" in out
    assert "step time 42.6" in out and "peak micro-batches in flight per stage: 4 4 4 4" in out
    assert Schedule.load(saved).n_stages == 4
    assert main(["schedule", "1f1b", "--limit", "2"]) == 2
    err = capsys.readouterr().err
    assert "--limit bounds a synthesised schedule's micro-batches in flight: use it with 'auto'" in err
    assert main(["schedule", "auto", "--forward", "1,2,3"]) == 2
    assert "--forward has 3 values for 4 stages; give one, or one per stage" in capsys.readouterr().err


def test_schedule_refuses_what_does_not_fit(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["schedule", "interleaved-1f1b", "--stages", "8", "--virtual", "2", "--microbatches", "6"]) == 2
    assert "multiple of the number of ranks" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["schedule", "pipedream"])


@pytest.mark.timeout(240)
def test_train_runs_the_main_job_on_local_processes(tmp_path: Path) -> None:
    out = tmp_path / "run"
    argv = ["--steps", "12", "--warmup", "2", "--batch-size", "8", "--seq-len", "32", "--eval-every", "6"]
    argv += ["--out", str(out), "--checkpoint-dir", str(out / "ckpt"), "--checkpoint-every", "6"]
    argv += ["--trace", str(out / "traces" / "step.json")]  # a folder that does not exist yet
    argv += ["--tensorboard", "--wandb", "--log-every", "4"]
    done = subprocess.run(
        [sys.executable, "-m", "stagewise", "-v", "train", *argv], capture_output=True, text=True, timeout=230,
        check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "stagewise.pipeline.pipe: rank 1 holds stages [1]" in done.stderr  # -v reaches the launched processes
    assert "backend gloo" in done.stdout and "pp=2 x dp=1 on 2 processes" in done.stdout
    # Output to a file, not a terminal: a line every 4 steps, not a progress bar's hundreds of redraws.
    assert "train:" not in done.stderr
    lines = [line for line in done.stdout.splitlines() if line.startswith("step ")]
    assert [line.split(":")[0] for line in lines] == ["step 4/12", "step 8/12", "step 12/12"], lines
    assert " tok/s, " in lines[0] and lines[0].endswith(" s/step")
    _check_metrics(out, done.stdout)
    summary = json.loads((out / "summary.json").read_text())
    assert len(summary["losses"]) == 12 and summary["losses"][-1] < summary["losses"][0] - 1.0
    assert [step for step, _ in summary["evals"]] == [6, 12]
    assert (out / "loss.png").stat().st_size > 0
    assert sorted(p.name for p in (out / "ckpt").iterdir()) == [".lock", "job", "step-00000006", "step-00000012"]
    assert f"checkpoint {out / 'ckpt' / 'step-00000012'}" in done.stdout
    for rank in range(2):
        events = json.loads((out / "traces" / f"step.rank{rank}.json").read_text())["traceEvents"]
        names = [e.get("name", "") for e in events]
        # The last training step's actions, as they ran: its backwards too (the evaluation after it runs forwards
        # only and must not overwrite the file).
        assert any(n.endswith("F0") for n in names) and any(n.endswith(f"{rank}B0") for n in names), names


def _check_metrics(out: Path, stdout: str) -> None:
    """metrics.jsonl, TensorBoard's events and the offline W&B run of a 12-step run that evaluated at 6 and 12."""
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    evals = [r for r in records if "eval_loss" in r]
    summary = json.loads((out / "summary.json").read_text())
    assert [r["step"] for r in steps] == list(range(1, 13)) and [r["loss"] for r in steps] == summary["losses"]
    for record in steps:
        assert record["grad_norm"] > 0 and record["lr"] > 0 and record["step_seconds"] > 0
        assert record["per_second"] == pytest.approx(8 * 32 / record["step_seconds"])
        assert 0 < record["mfu"] < 1
        assert len(record["peak_memory"]) == 2 and min(record["peak_memory"]) > 50 * 2**20  # each rank's RSS
    assert [(r["step"], r["eval_loss"]) for r in evals] == [tuple(e) for e in summary["evals"]]
    assert evals[-1]["perplexity"] == pytest.approx(math.exp(evals[-1]["eval_loss"]))
    assert f"perplexity {evals[-1]['perplexity']:.2f}" in stdout
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    losses = events.Scalars("train/loss")
    assert [e.step for e in losses] == list(range(1, 13))
    assert [e.value for e in losses] == pytest.approx(summary["losses"], rel=1e-6)
    assert [e.step for e in events.Scalars("eval/perplexity")] == [6, 12]
    assert "train/mfu" in events.Tags()["scalars"]
    offline = list((out / "wandb").glob("wandb/offline-run-*/run-*.wandb"))
    assert len(offline) == 1 and b"train/grad_norm" in offline[0].read_bytes()


def test_train_help_documents_every_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = capsys.readouterr().out
    for flag in ("--model", "--pp", "--dp", "--schedule", "--microbatches", "--batch-size", "--seq-len", "--steps",
                 "--lr", "--optimizer", "--bf16", "--activation-checkpointing", "--seed", "--data", "--checkpoint-dir",
                 "--checkpoint-every", "--resume", "--trace", "--weight-gradient-pool",
                 "--no-weight-gradient-fusion", "--pin-cores", "--compile"):  # fmt: skip
        assert flag in text, flag


def test_train_flags_set_how_weight_gradients_accumulate() -> None:
    def config(*argv: str) -> TrainConfig:
        return config_of(parser().parse_args(["train", *argv]))

    assert (config().weight_gradient_fusion, config().weight_gradient_pool) == (True, "free")
    assert config("--weight-gradient-pool", "3").weight_gradient_pool == 3
    assert config("--weight-gradient-pool", "free").weight_gradient_pool == "free"
    assert config("--no-weight-gradient-fusion").weight_gradient_fusion is False
    assert config().data_limit is None and config("--data-limit", "64MiB").data_limit == 64 << 20
    assert config().compile is False and config("--compile").compile is True


def test_train_flags_choose_what_a_stage_keeps_recomputes_shards_and_offloads() -> None:
    def options(*argv: str) -> PipelineOptions:
        return pipeline_options(config_of(parser().parse_args(["train", *argv])))

    plain = options()
    assert plain.fully_sharded == "auto" and plain.compute.offload_activations is False
    assert plain.compute.activation_checkpointing is False
    chosen = options(
        "--fsdp", "2", "--fsdp-gather", "micro-batch", "--offload-optimizer", "--offload-activations",
        "--activation-checkpointing", "selective",
    )  # fmt: skip
    assert chosen.fully_sharded == FullySharded(gather="micro-batch", offload=True)
    assert chosen.compute.offload_activations is True
    assert isinstance(chosen.compute.activation_checkpointing, SelectiveCheckpointing)
    assert options("--offload-optimizer").fully_sharded == FullySharded(offload=True)  # one rank's offload


class LaunchedError(Exception):
    """Raised by a stand-in for launch once it has seen its options."""


def test_launcher_options_reach_launch_and_are_refused_under_torchrun(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    monkeypatch.chdir(tmp_path)  # the default checkpoint and output folders: fresh ones
    seen: list[dict[str, object]] = []

    def launch(fn: object, nprocs: int, *args: object, **options: object) -> None:
        seen.append(options)
        raise LaunchedError

    monkeypatch.setattr(launching, "launch", launch)
    for argv in (["train"], ["train", "--pin-cores"]):
        with pytest.raises(LaunchedError):
            cli_train.run(parser().parse_args(argv))
    assert [options["pin_cores"] for options in seen] == [False, True]
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "a-torchrun-job")  # as torchrun sets it
    assert main(["train", "--pin-cores"]) == 2
    assert "--pin-cores applies when stagewise starts the processes; torchrun started these" in capsys.readouterr().err
    assert main(["train", "--max-restarts", "3"]) == 2
    restarts = "give torchrun --max-restarts (a restarted run resumes from --checkpoint-dir by itself)"
    assert restarts in capsys.readouterr().err
    assert main(["train", "--max-restarts", "-4"]) == 2
    assert "--max-restarts must be >= 0, got -4" in capsys.readouterr().err


def test_train_refuses_bad_values(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "--model", "gpt-tiny", "--resume", "--no-checkpoints"]) == 2
    assert "resume needs checkpoint_dir" in capsys.readouterr().err
    assert main(["train", "--stop-after", "500"]) == 2
    assert "stop_after must be in 1..steps=400, got 500" in capsys.readouterr().err
    assert main(["train", "--stop-after", "4", "--no-checkpoints"]) == 2  # was accepted: nothing to resume from
    assert "stop_after=4 ends the run to resume it later, but without checkpoint_dir nothing is saved" in (
        capsys.readouterr().err
    )
    for flag, value in (("--seq-len", "64"), ("--data", "books/"), ("--data-limit", "1MiB")):
        assert main(["train", "--model", "mlp-tiny", flag, value]) == 2
        assert f"{flag} applies to language models, which read text; mlp-tiny trains on data of its own" in (
            capsys.readouterr().err
        )
    assert main(["train", "--no-weight-gradient-fusion", "--weight-gradient-pool", "2"]) == 2
    assert "weight_gradient_pool=2 pools fused weight gradients, but weight_gradient_fusion is off" in (
        capsys.readouterr().err
    )
    with pytest.raises(SystemExit):
        main(["train", "--weight-gradient-pool", "0"])
    assert "--weight-gradient-pool: expected a number >= 1 or 'free', got 0" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--pp", "1", "--virtual", "8"], "cannot split 7 layers into 8 non-empty stages; use n_stages <= 7"),
        (["--fsdp-gather", "micro-batch"], "fsdp_gather='micro-batch' gathers each stage's sharded parameters around"),
        (["--schedule", "interleaved-1f1b"], "interleaved-1f1b needs n_virtual >= 2 stages per rank, got 1"),
        (["--batch-size", "2", "--microbatches", "4"], "global_batch_size=2 is smaller than dp=1 x n_microbatches=4"),
        (["--seq-len", "4096"], "seq_len=4096 exceeds gpt-tiny's longest sequence, 128"),
        (["--data", "/nonexistent"], "no text file or folder at /nonexistent; pass an existing --data path"),
        (["--timeout", "inf"], "timeout must be a positive, finite number, got inf"),
        (["--clip", "nan"], "clip must be a finite number >= 0 (0 turns it off), got nan"),
    ],
)
def test_train_refuses_what_its_ranks_would_before_starting_them(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # These reached the launched processes: exit 1 and a traceback from each rank, after the start-up.
    monkeypatch.setattr(launching, "launch", None)  # nothing may be launched
    assert main(["train", "--no-checkpoints", "--out", str(tmp_path), *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err, err


def test_outputs_that_cannot_be_written_are_refused_before_training(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # An unwritable --out, --trace or checkpoint folder was found only after every step had run.
    blocked = tmp_path / "a-file"
    blocked.write_text("not a folder")
    assert main(["train", "--no-checkpoints", "--out", str(blocked / "out")]) == 2
    assert f"--out: cannot make the folder {blocked}/out (Not a directory); choose a writable one" in (
        capsys.readouterr().err
    )
    assert main(["train", "--no-checkpoints", "--trace", str(blocked / "step.json"), "--out", str(tmp_path)]) == 2
    assert f"--trace: cannot make the folder {blocked} (File exists)" in capsys.readouterr().err


def test_a_fresh_run_into_an_earlier_runs_checkpoints_is_refused_before_any_process_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Refused only inside the launched processes, a run with --max-restarts was restarted by the agent, and the
    # restart continued the earlier run's checkpoints.
    (tmp_path / "step-00000004").mkdir()
    (tmp_path / "step-00000004" / ".metadata").write_bytes(b"")
    code = main(["train", "--checkpoint-dir", str(tmp_path), "--max-restarts", "1", "--out", str(tmp_path / "o")])
    assert code == 2
    assert "already holds checkpoints (the latest step-00000004), from an earlier run" in capsys.readouterr().err


def test_the_summary_is_strict_json_when_a_step_was_skipped(tmp_path: Path) -> None:
    # A skipped step's NaN loss was written as a bare NaN, which strict JSON readers refuse.
    summary = Summary({"model": "gpt-tiny"}, [0, 7], 10, 0, losses=[2.5, float("nan"), 2.0], skipped=[2])
    summary.step_seconds = [0.1, 0.1, 0.1]
    run_report.report(summary, tmp_path)
    text = (tmp_path / "summary.json").read_text()
    data = json.loads(text, parse_constant=lambda word: pytest.fail(f"not strict JSON: {word}"))
    assert data["losses"] == [2.5, None, 2.0] and data["skipped"] == [2]


def test_more_processes_than_cores_are_named_with_the_numbers() -> None:
    # --dp 8 on 2 cores started 16 processes without a word.
    assert launching.crowding(16, 2) == (
        "16 processes share 2 CPU cores, so each step waits for processes that are not running; at most 2 processes "
        "(--pp x --dp x --fsdp x --tp) run at full speed"
    )
    assert launching.crowding(2, 2) is None


def test_help_shows_the_defaults_and_no_markup(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "``" not in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "optimizer steps, the schedule's length (default 400)" in text
    assert "warm-up steps (default 10)" in text
    assert "--plan PLAN a plan from `stagewise plan --json` (sets the layout it chose)" in text


PLAN = {
    "model": "gpt-tiny", "pp": 2, "dp": 1, "fsdp": 1, "tp": 1, "virtual": 1, "schedule": "1f1b",
    "microbatches": 4, "batch_size": 8, "seq_len": 32, "activation_checkpointing": False, "optimizer": "adamw",
    "partition": [0, 3, 7],
}  # fmt: skip
"""A plan as `stagewise plan --json` writes it, for two stages of gpt-tiny."""


@pytest.mark.parametrize(
    ("changed", "message"),
    [
        ({"optimizer": "lion"}, 'the plan\'s "optimizer" is "lion", not one of "adamw", "sgd", or null; write one of'),
        ({"activation_checkpointing": "no"}, 'the plan\'s "activation_checkpointing" is "no", not true, false or'),
        ({"partition": [0, 2.5, 7]}, 'the plan\'s "partition" is [0, 2.5, 7], not a list of whole numbers'),
        ({"schedule_text": 5}, 'the plan\'s "schedule_text" is 5, not a schedule\'s text'),
        ({"schedule_text": "rank 0: 3000000000F0"}, 'the plan\'s "schedule_text" is "rank 0: 3000000000F0", outside '
         "the plan's layout at line 1: 3000000000F0 runs stage 3000000000"),
        ({"model": "os:getcwd"}, 'the plan\'s "model" is "os:getcwd", code (MODULE:FACTORY), which a plan file may '
         "not name: it would be imported and run in every process; give --model os:getcwd on the command line"),
    ],
    ids=lambda case: next(iter(case)) if isinstance(case, dict) else None,
)  # fmt: skip
def test_train_refuses_a_plan_with_a_bad_field_in_one_line_before_any_process_starts(
    changed: dict[str, object],
    message: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Each trained something else (AdamW, checkpointing on, partition (0, 2, 7)), failed on every rank, or
    # imported and ran the file's code in the launcher and on every rank.
    def preflight(config: TrainConfig) -> None:
        raise AssertionError(f"the plan reached preflight: {config}")  # which would read a schedule of 3e9 stages

    monkeypatch.setattr(launching, "launch", None)  # nothing may be launched
    monkeypatch.setattr(launching, "preflight", preflight)
    bad = tmp_path / "plan.json"
    bad.write_text(json.dumps(sectioned({**PLAN, **changed})))
    assert main(["train", "--plan", str(bad), "--no-checkpoints", "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"stagewise train: error: {message}"), err
    assert err.count("\n") == 1 and "Traceback" not in err, err


def test_a_plan_naming_a_factory_trains_it_when_the_command_line_names_it_too(tmp_path: Path) -> None:
    planned = tmp_path / "plan.json"
    planned.write_text(json.dumps(sectioned({**PLAN, "model": "mypackage.models:make"})))
    config = config_of(parser().parse_args(["train", "--plan", str(planned), "--model", "mypackage.models:make"]))
    assert (config.model, config.pp, config.partition) == ("mypackage.models:make", 2, (0, 3, 7))
    with pytest.raises(ValueError, match=r'"model" is "mypackage\.models:make", code'):
        config_of(parser().parse_args(["train", "--plan", str(planned), "--model", "gpt-tiny"]))
    planned.write_text(json.dumps(sectioned(PLAN)))
    assert config_of(parser().parse_args(["train", "--plan", str(planned)])).optimizer == "adamw"


def test_a_seed_torch_cannot_take_on_every_rank_is_refused(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(launching, "launch", None)  # nothing may be launched
    # torch.manual_seed takes -2**63 .. 2**64 - 1, and each layer's seed is seed x 1000003 + its index:
    # 2**64 passed the checks and overflowed on every rank, and so did 2**45 in the layers' seeds.
    highest, lowest = 18446688733642, -9223344366821
    for seed in (2**64, 2**45, highest + 1, lowest - 1):
        with pytest.raises(SystemExit):
            main(["train", "--seed", str(seed)])
        assert f"argument --seed: must be a whole number from {lowest} to {highest}, got {seed}: each layer" in (
            capsys.readouterr().err
        )
        with pytest.raises(ValueError, match=f"seed must be a whole number from {lowest} to {highest}, got {seed}"):
            TrainConfig(seed=seed)
    with pytest.raises(ValueError, match="got True"):
        TrainConfig(seed=True)
    for seed in (highest, lowest, 0, -1):
        assert config_of(parser().parse_args(["train", "--seed", str(seed)])).seed == seed
        torch.manual_seed(seed * 1_000_003 + 1_000_002)  # the last layer's seed of the largest model torch takes
        torch.manual_seed(seed * 1_000_003)


def test_rank_0_of_a_job_on_several_nodes_says_where_they_meet(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from stagewise.cli.train import _say_where_nodes_meet

    env = {"RANK": "0", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4", "MASTER_ADDR": "node0", "MASTER_PORT": "29500"}
    for key, value in {**env, "TORCHELASTIC_RUN_ID": "job7"}.items():
        monkeypatch.setenv(key, value)
    _say_where_nodes_meet()
    out = capsys.readouterr().out
    assert "8 processes on several nodes; the job's store is node0:29500 (job id job7)" in out
    assert "keep the nodes on a trusted network" in out
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")  # one node: its store listens on loopback alone
    _say_where_nodes_meet()
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "5")  # only rank 0 prints
    _say_where_nodes_meet()
    assert capsys.readouterr().out == ""
