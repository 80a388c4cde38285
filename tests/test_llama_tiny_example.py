"""The README's second example runs as written: a tokenizer and a Llama config made here, trained from its job
file, exported, loaded with from_pretrained and sampled (fewer steps and a smaller corpus, to keep it short)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
EXAMPLE = ROOT / "examples" / "llama_tiny.py"
JOB = ROOT / "examples" / "llama-tiny.toml"


def _run(argv: list[str], cwd: Path, timeout: float) -> str:
    done = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=timeout, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_the_readme_names_these_commands() -> None:
    readme = (ROOT / "README.md").read_text()
    for command in (
        "python examples/llama_tiny.py prepare",
        "python -m stagewise train --config examples/llama-tiny.toml",
        "python examples/llama_tiny.py sample",
    ):
        assert command in readme


@pytest.mark.timeout(300)
def test_a_llama_with_its_own_tokenizer_trains_from_its_job_file_and_samples(tmp_path: Path) -> None:
    made = _run([sys.executable, str(EXAMPLE), "prepare", "--limit", "1500000"], tmp_path, 120)
    assert "a 8192-token BPE tokenizer, a Llama config" in made
    argv = [sys.executable, "-m", "stagewise", "train", "--config", str(JOB), "--steps", "40", "--eval-every", "20"]
    trained = _run([*argv, "--out", "run"], tmp_path, 240)
    assert "perplexity" in trained
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r]
    assert len(losses) == 40 and losses[0] == pytest.approx(math.log(8192), abs=0.3)  # a uniform guess at first
    assert sum(losses[-5:]) / 5 < losses[0] - 2.0  # it learns the tokenized source
    perplexities = [r["perplexity"] for r in records if "perplexity" in r]
    assert len(perplexities) == 2 and perplexities[1] < perplexities[0] < 8192
    kept = (tmp_path / "run" / "config.toml").read_text()
    assert 'model = "hf:stagewise-run/llama-tiny/model"' in kept and "steps = 40" in kept
    sampled = _run([sys.executable, str(EXAMPLE), "sample", "--run", "run", "--prompt", "def "], tmp_path, 120)
    head, text = sampled.split("; a sample:\n", 1)
    assert "exported step-00000040 to " in head and (tmp_path / "run" / "export" / "config.json").is_file()
    assert text.startswith("def ") and len(text.strip()) > len("def ")
