"""Pretrained Hugging Face weights read per stage, and a trained pipeline exported back as a from_pretrained folder."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
import transformers
from support.hf import batch, build
from support.multiproc import run_ranks

from stagewise import checkpoint
from stagewise.checkpoint import Progress
from stagewise.comm import init_mesh
from stagewise.partition import Partition, capture
from stagewise.pipeline import Pipeline, PretrainedError, load_pretrained
from stagewise.pipeline.pretrained import weight_files

LENGTH = 12


def shifted_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """A causal LM's loss as Hugging Face computes it from ``labels=input_ids``: each token predicts the next."""
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


def load_train_and_save(weights: Path, saved: Path) -> dict[str, Any]:
    torch.set_num_threads(1)
    mesh = init_mesh(2, timeout=60)
    chain = capture(build("gpt2", meta=True), batch(2, LENGTH, seed=0))
    pipe = Pipeline(chain, Partition.from_bounds((0, 2, 4)), n_microbatches=2, loss_fn=shifted_loss, mesh=mesh)
    read = load_pretrained(pipe, weights)
    inputs = batch(4, LENGTH, seed=1)
    loss = pipe.evaluate(inputs, inputs["input_ids"]).item()
    opt = torch.optim.SGD(pipe.parameters(), lr=0.5)
    pipe.step(inputs, inputs["input_ids"])
    opt.step()
    logits = pipe.predict(inputs)
    checkpoint.save(saved, pipe, opt, Progress(step=1, epoch=0, batch=1))
    dist.destroy_process_group()
    return {"loss": loss, "bytes": read.bytes_read, "files": [f.name for f in read.files], "logits": logits}


def test_pretrained_weights_load_per_stage_and_the_export_loads_with_from_pretrained(tmp_path: Path) -> None:
    torch.manual_seed(3)
    model = build("gpt2")
    model.save_pretrained(tmp_path / "gpt2", max_shard_size="40KB")  # shards and their index
    assert (tmp_path / "gpt2" / "model.safetensors.index.json").is_file()
    inputs = batch(4, LENGTH, seed=1)
    with torch.no_grad():
        expected = model(**inputs, labels=inputs["input_ids"]).loss.item()
    results = run_ranks(load_train_and_save, 2, tmp_path / "gpt2", tmp_path / "ckpt", timeout=120)
    total = sum(t.numel() * t.element_size() for t in model.state_dict().values() if t is not model.lm_head.weight)
    for rank, got in results.items():
        assert got["loss"] == pytest.approx(expected, abs=1e-5), rank  # HF's own loss, from weights read per stage
        assert got["bytes"] < 0.75 * total, (rank, got["bytes"], total)  # its share, not the whole model
    assert sum(got["bytes"] for got in results.values()) < 1.2 * total  # the tied embedding is read on both ranks
    assert set(results[0]["files"]) != set(results[1]["files"])  # each opened the shards that hold its tensors

    exported = checkpoint.export(
        checkpoint.latest(tmp_path / "ckpt"), tmp_path / "hf", format="hf", config=model.config
    )
    again = transformers.GPT2LMHeadModel.from_pretrained(exported)
    assert again.lm_head.weight is again.transformer.wte.weight
    with torch.no_grad():
        torch.testing.assert_close(again(**inputs).logits, results[1]["logits"], atol=1e-5, rtol=1e-5)
    assert sorted(weight_files(exported)) == sorted(model.state_dict())  # every name, both of the tie


def test_weights_that_are_not_there_or_do_not_fit_are_refused(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(PretrainedError, match=r"holds no .safetensors weights \(pickled .bin weights: save them again"):
        weight_files(tmp_path / "empty")
    with pytest.raises(PretrainedError, match=r"is neither a .safetensors file nor a folder of them"):
        weight_files(tmp_path / "nothing")
    with pytest.raises(TypeError, match=r"format='hf' writes the model's config.json too: pass config=model.config"):
        checkpoint.export(tmp_path, tmp_path / "out", format="hf")
