"""`stagewise train --model hf:DIR` trains a local Hugging Face folder as it is, from its own weights."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from support.corpus import bpe_folder, texts, write_json_lines
from support.hf import batch

from stagewise import checkpoint
from stagewise.cli import main
from stagewise.run import TrainConfig


def test_a_saved_gpt2_is_planned_trains_from_its_weights_and_its_checkpoint_exports_to_from_pretrained(
    tmp_path: Path,
) -> None:
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=3, n_embd=32, n_head=2, vocab_size=256, n_positions=64, bos_token_id=0, eos_token_id=0
    )
    model = transformers.GPT2LMHeadModel(config)
    with torch.no_grad():
        model.transformer.wte.weight.mul_(40)  # weights no initialiser draws: confident, wrong logits at first
    model.save_pretrained(tmp_path / "gpt2")
    out, plan = tmp_path / "run", tmp_path / "plan.json"
    model_flag = ["--model", f"hf:{tmp_path / 'gpt2'}"]
    assert main(["plan", *model_flag, "--gpus", "2", "--batch-size", "8", "--seq-len", "32", "--json", str(plan)]) == 0
    assert json.loads(plan.read_text())["model"]["model"] == f"hf:{tmp_path / 'gpt2'}"
    # The folder has no tokenizer of its own: its 256 ids are bytes, said so.
    argv = [
        *model_flag,
        "--tokenizer",
        "bytes",
        "--plan",
        str(plan),
        "--steps",
        "30",
        "--eval-every",
        "0",
    ]  # no tokenizer of its own
    argv += ["--out", str(out), "--checkpoint-dir", str(out / "ckpt")]
    done = subprocess.run(
        [sys.executable, "-m", "stagewise", "train", *argv], capture_output=True, text=True, timeout=200, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    losses = json.loads((out / "summary.json").read_text())["losses"]
    assert losses[0] > 8, losses  # a fresh model's would be about ln(256) = 5.5: the folder's weights were read
    assert len(losses) == 30 and sum(losses[-5:]) / 5 < losses[0] - 1.0, losses
    exported = checkpoint.export(checkpoint.latest(out / "ckpt"), tmp_path / "hf", format="hf", config=config)
    trained = transformers.GPT2LMHeadModel.from_pretrained(exported)
    stored = torch.load(checkpoint.export(checkpoint.latest(out / "ckpt"), tmp_path / "plain.pt"), weights_only=True)
    for name, value in trained.state_dict().items():
        torch.testing.assert_close(value, stored[name], atol=0, rtol=0, msg=name)
    assert torch.isfinite(trained(**batch(2, 16, seed=0)).logits).all()


def test_a_model_that_is_not_there_is_refused_with_the_forms_a_model_takes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        main(["train", "--model", f"hf:{tmp_path}"])
    assert f"{tmp_path} holds no config.json; give a folder save_pretrained wrote" in capsys.readouterr().err
    with pytest.raises(
        ValueError, match=r"unknown model 'gpt-huge': give a preset \(.*\), hf:DIR .* or MODULE:FACTORY"
    ):
        TrainConfig(model="gpt-huge")


def test_a_folder_whose_config_names_code_of_its_own_is_refused_without_running_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # transformers would import the folder's modeling code (or prompt for trust_remote_code on a terminal).
    marker = tmp_path / "ran"
    (tmp_path / "modeling_evil.py").write_text(f"import os\nos.mkdir({str(marker)!r})\n")
    auto_map = {"AutoConfig": "modeling_evil.EvilConfig", "AutoModelForCausalLM": "modeling_evil.Evil"}
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "evil", "auto_map": auto_map}))
    with pytest.raises(SystemExit):
        main(["train", "--model", f"hf:{tmp_path}"])
    err = capsys.readouterr().err
    assert "names code of its own (auto_map ['AutoConfig', 'AutoModelForCausalLM']), which stagewise never runs" in err
    with pytest.raises(ValueError, match="which stagewise never runs"):
        TrainConfig(model=f"hf:{tmp_path}")
    assert not marker.exists()


@pytest.mark.timeout(240)
def test_a_folder_with_its_own_8k_tokenizer_trains_on_json_lines_and_reports_its_metrics(tmp_path: Path) -> None:
    """On packed documents kept apart (document masking)."""
    # The folder's tokenizer was ignored: its 1,000-token model trained on byte values used as token ids.
    documents = texts(60)
    folder = bpe_folder(tmp_path / "llama", documents, 8192)
    corpus = write_json_lines(tmp_path / "docs.jsonl", documents)
    argv = ["--model", f"hf:{folder}", "--data", str(corpus), "--steps", "30", "--warmup", "3", "--batch-size", "8"]
    argv += ["--seq-len", "64", "--eval-every", "15", "--lr", "3e-3", "--tensorboard", "--out", str(tmp_path / "run")]
    argv += ["--document-masking"]  # its documents apart, through position_ids
    done = subprocess.run(
        [sys.executable, "-m", "stagewise", "train", *argv], capture_output=True, text=True, timeout=230,
        cwd=tmp_path, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"tokenizing {corpus} with {folder} (once)" in done.stdout
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r]
    assert len(losses) == 30 and losses[0] == pytest.approx(math.log(8192), abs=0.3)  # a uniform guess at first
    assert sum(losses[-5:]) / 5 < losses[0] - 1.5  # and it learns the tokenized text
    assert [r["step"] for r in records if "perplexity" in r] == [15, 30]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "run" / "tensorboard"))
    events.Reload()
    assert [e.value for e in events.Scalars("train/loss")] == pytest.approx(losses, rel=1e-6)
    tokens = list((tmp_path / "stagewise-run" / "tokens").iterdir())
    assert len(tokens) == 1 and json.loads((tokens[0] / "meta.json").read_text())["vocab_size"] == 8192
