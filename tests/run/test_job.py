"""The job file: one schema for a run's settings, the same in the TOML file, the flags and the plan file."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import pytest

from stagewise.cli import main, parser
from stagewise.cli.train import COMMAND_ONLY, config_of
from stagewise.plan.plan_file import FIELDS
from stagewise.run import TrainConfig
from stagewise.run.job import SECTION_OF, SECTIONS, JobFileError, config_text, read_job, resolved
from stagewise.run.runs import IN_RUN_FOLDER, in_folder, keep_config

UNUSUAL = TrainConfig(
    model="gpt-tiny-tied", pp=2, virtual=2, dp=1, fsdp=1, tp=1, schedule="interleaved-1f1b", microbatches=2,
    batch_size=8, seq_len=32, steps=7, stop_after=3, lr=1e-3, warmup=0, optimizer="sgd", clip=0.0, bf16=True,
    weight_gradient_pool=None, seed=11, data="corpus.jsonl", tokenizer="bytes", data_field="body", data_limit=4096,
    document_masking=True, eval_every=0, checkpoint_dir="/tmp/ckpt", checkpoint_every=2, checkpoint_async=True,
    verify_checksums=False, tensorboard="RUN/tb", log_every=3, timeout=12.5, nonfinite="skip",
    partition=(0, 2, 4, 6, 7), schedule_text="# a schedule\nrank 0: 0F0\nrank 1: 1F0\n",
)  # fmt: skip
"""A run whose every section differs from the defaults somewhere: None, tuples, text of several lines."""


def _train_actions() -> list[argparse.Action]:
    commands = next(a for a in parser()._actions if isinstance(a, argparse._SubParsersAction))
    return list(commands.choices["train"]._actions)


def test_every_setting_has_one_section_and_one_flag_of_its_own_name() -> None:
    fields = [f.name for f in dataclasses.fields(TrainConfig)]
    keys = [key for keys in SECTIONS.values() for key in keys]
    assert sorted(keys) == sorted(fields) and len(keys) == len(set(keys))
    flags: dict[str, list[str]] = {}
    for action in _train_actions():
        if action.dest not in (*COMMAND_ONLY, "help"):
            flags.setdefault(action.dest, []).extend(action.option_strings)
    assert set(flags) == set(fields) - {"schedule_text"}  # a synthesised schedule comes in a plan or a job file
    for name, options in flags.items():
        spelled = "--" + name.replace("_", "-")
        assert spelled in options or f"--no-{spelled[2:]}" in options, (name, options)


def test_a_plan_file_holds_its_settings_in_the_job_files_sections() -> None:
    for field in FIELDS:
        if field.name != "predicted":
            assert SECTION_OF[field.name] == field.section, field.name


def test_the_job_file_of_a_config_reads_back_as_that_config(tmp_path: Path) -> None:
    path = tmp_path / "run.toml"
    path.write_text(config_text(UNUSUAL))
    assert TrainConfig(**read_job(path)) == UNUSUAL
    assert TrainConfig(**read_job(_written(tmp_path, config_text(TrainConfig())))) == TrainConfig()
    text = path.read_text()
    assert "[layout]\npp = 2\n" in text and "weight_gradient_pool = false" in text and "wandb" not in text


def _written(tmp_path: Path, text: str, name: str = "job.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_train_reads_a_job_file_flags_override_it_and_print_config_prints_the_result(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    job = _written(
        tmp_path, '[layout]\npp = 1\ndp = 2\n\n[optimizer]\nsteps = 20\nlr = 1\n\n[schedule]\nschedule = "gpipe"\n'
    )
    assert main(["train", "--config", str(job), "--steps", "30", "--print-config"]) == 0
    printed = capsys.readouterr().out
    config = TrainConfig(**read_job(_written(tmp_path, printed, "printed.toml")))
    assert (config.pp, config.dp, config.steps, config.lr, config.schedule) == (1, 2, 30, 1.0, "gpipe")
    assert config.checkpoint_dir == IN_RUN_FOLDER["checkpoint_dir"] and config.metrics == IN_RUN_FOLDER["metrics"]
    # Printed again from its own output: the same file.
    assert main(["train", "--config", str(tmp_path / "printed.toml"), "--print-config"]) == 0
    assert capsys.readouterr().out == printed
    assert config_of(parser().parse_args(["train", "--config", str(job), "--no-checkpoints"])).checkpoint_dir is None


def test_a_run_folder_keeps_the_settings_it_ran_with(tmp_path: Path) -> None:
    config = in_folder(resolved({}, defaults=IN_RUN_FOLDER), tmp_path)
    kept = keep_config(tmp_path, config)
    assert kept == tmp_path / "config.toml" and TrainConfig(**read_job(kept)) == config
    assert config.checkpoint_dir == str(tmp_path / "checkpoints") and config.metrics == str(tmp_path / "metrics.jsonl")
    assert not list(tmp_path.glob(".config.toml*"))  # staged, then renamed


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[layuot]\npp = 2\n", "[layuot] is not a section of a job file; the sections are ['model', 'data', 'layout'"),
        ("[layout]\nstages = 2\n", "[layout] stages is not a setting; [layout] takes ['pp', 'dp', 'fsdp', 'tp', "),
        ("[model]\nlr = 0.1\n", "lr belongs in [optimizer], not [model]; move it there"),
        ("[layout]\npp = 2.5\n", "[layout] pp = 2.5 is not a whole number"),
        ("[layout]\npp = true\n", "[layout] pp = True is not a whole number"),
        ('[schedule]\nschedule = "1F1B"\n', "[schedule] schedule = '1F1B' is not one of 'gpipe', '1f1b'"),
        ("[compute]\nbf16 = 1\n", "[compute] bf16 = 1 is not true or false"),
        ("[compute]\nweight_gradient_pool = 0.5\n", "weight_gradient_pool = 0.5 is not a whole number or one of "
         "'free' (or false: off)"),
        ('[data]\ndata_limit = "lots"\n', "[data] data_limit: "),
        ("[layout]\npartition = [0, 2.5]\n", "partition = [0, 2.5] is not a list of whole numbers (or false: off)"),
        ("model = 'gpt-tiny'\n", "model must be a section ([model]) of keys, got 'gpt-tiny'"),
        ("[layout\npp = 2\n", "is not a TOML file (Expected ']' at the end of a table declaration (at line 1, "),
    ],
    ids=lambda case: case[:24],
)  # fmt: skip
def test_a_bad_job_file_is_refused_in_one_line_naming_the_key_and_the_fix(
    text: str, message: str, tmp_path: Path
) -> None:
    path = _written(tmp_path, text)
    with pytest.raises(JobFileError) as info:
        read_job(path)
    assert message in str(info.value) and str(info.value).startswith(str(path)), str(info.value)
    assert "\n" not in str(info.value), str(info.value)


def test_a_job_file_that_cannot_be_read_or_whose_values_clash_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["train", "--config", str(tmp_path / "missing.toml"), "--print-config"]) == 2
    assert "cannot read the job file " in capsys.readouterr().err
    job = _written(tmp_path, '[model]\nmodel = "mlp-tiny"\n\n[data]\ndata = "corpus.txt"\n')
    assert main(["train", "--config", str(job), "--print-config"]) == 2
    assert "--data applies to language models, which read text; mlp-tiny trains on data of its own" in (
        capsys.readouterr().err
    )
    job = _written(tmp_path, "[layout]\npp = 0\n")
    assert main(["train", "--config", str(job), "--print-config"]) == 2
    assert "pp must be a whole number >= 1, got 0" in capsys.readouterr().err


def test_the_job_file_the_command_line_guide_shows_reads(tmp_path: Path) -> None:
    guide = (Path(__file__).parents[2] / "docs" / "cli.md").read_text()
    shown = guide.split("```toml\n", 1)[1].split("```", 1)[0]
    config = TrainConfig(**read_job(_written(tmp_path, shown)))
    assert (config.model, config.seq_len, config.pp, config.steps) == ("gpt-tiny", 64, 2, 50)


def test_a_job_file_naming_code_is_refused_unless_the_command_line_names_it(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    job = _written(tmp_path, f'[model]\nmodel = "os:mkdir"\n\n[data]\ndata = "{marker}"\n')
    with pytest.raises(JobFileError, match=r"\[model\] model = 'os:mkdir' names code \(MODULE:FACTORY\), which a job"):
        resolved({}, job_file=job)
    assert not marker.exists()  # nothing imported or run
    config = resolved({"model": "os:mkdir"}, job_file=job)  # the command line's own: trusted, as the user's code
    assert config.model == "os:mkdir" and not marker.exists()
