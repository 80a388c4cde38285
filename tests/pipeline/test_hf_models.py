"""Hugging Face models, unwrapped and built on the meta device, train on 2 gloo processes as the unsplit model."""

from __future__ import annotations

import copy
import functools
from typing import Any

import torch
import torch.distributed as dist
from support.hf import KINDS, Kind, batch, build, lm_loss, steps, train_pipeline, train_unsplit
from support.multiproc import run_ranks

from stagewise.comm import init_mesh
from stagewise.partition import Partition, capture
from stagewise.pipeline import Pipeline, PipelineOptions, materialise_model

STEPS = 3
BATCH = 7  # 3 micro-batches of 3, 2 and 2 samples (interleaved: 4 of 2, 2, 2 and 1)
MICRO = 3
LENGTHS = (16, 12, 20)
"""Captured at the first length; the steps run at each."""
SEED = 5
SCHEDULES = ("1f1b", "gpipe", "zero-bubble", "interleaved-1f1b")


@functools.cache
def unsplit(kind: Kind) -> dict[str, Any]:
    """The model itself (not its capture), initialised as the pipeline's layers are, trained on whole batches."""
    model = build(kind, meta=True)
    materialise_model(capture(model, batch(MICRO, LENGTHS[0], seed=0)), seed=SEED)
    return train_unsplit(model, steps(BATCH, LENGTHS), lr=0.5)


def trained(pipe: Pipeline) -> dict[str, Any]:
    """The losses of ``pipe`` over the steps of SGD, and its parameters after them."""
    return train_pipeline(pipe, steps(BATCH, LENGTHS), lr=0.5)


def train_every_schedule() -> dict[str, Any]:
    torch.set_num_threads(1)
    mesh = init_mesh(2, timeout=60)
    results: dict[str, Any] = {}
    for kind in KINDS:
        captured = capture(build(kind, meta=True), batch(MICRO, LENGTHS[0], seed=0))
        for schedule in SCHEDULES:
            chain = copy.deepcopy(captured)
            n_stages = 4 if schedule == "interleaved-1f1b" else 2
            part = Partition.from_bounds((0, 1, 2, 3, 4) if n_stages == 4 else (0, 2, 4))
            pipe = Pipeline(
                chain, part, schedule=schedule, n_microbatches=MICRO if n_stages == 2 else 4,
                loss_fn=lm_loss, mesh=mesh,
                options=PipelineOptions(seed=SEED, n_virtual=n_stages // 2),
            )  # fmt: skip
            allocated = sum(p.numel() for p in chain.parameters() if not p.is_meta)
            own = sum(p.numel() for p in pipe.parameters())
            results[f"{kind} {schedule}"] = {**trained(pipe), "allocated": allocated, "own": own}
            pipe.close()
    dist.destroy_process_group()
    return results


def test_gpt2_llama_and_bert_built_on_meta_train_as_the_unsplit_model_under_every_schedule_at_any_length() -> None:
    results = run_ranks(train_every_schedule, 2, timeout=240)
    for kind in KINDS:
        want = unsplit(kind)
        for schedule in SCHEDULES:
            case = f"{kind} {schedule}"
            merged: dict[str, torch.Tensor] = {}
            for rank, got in results.items():
                torch.testing.assert_close(got[case]["losses"], want["losses"], atol=1e-5, rtol=1e-5, msg=case)
                assert got[case]["allocated"] == got[case]["own"], (case, rank)  # only its own stages are real
                merged.update(got[case]["params"])
            assert sorted(merged) == sorted(want["state"]), case
            for name, value in want["state"].items():
                torch.testing.assert_close(merged[name], value, atol=1e-5, rtol=1e-5, msg=f"{case}: {name}")


def train_in_one_stage(schedule: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    mesh = init_mesh(1, timeout=60)
    chain = capture(build("gpt2", meta=True), batch(MICRO, LENGTHS[0], seed=0))
    pipe = Pipeline(
        chain, Partition.from_bounds((0, 4)), schedule=schedule, n_microbatches=MICRO, loss_fn=lm_loss, mesh=mesh,
        options=PipelineOptions(seed=SEED),
    )  # fmt: skip
    result = trained(pipe)
    dist.destroy_process_group()
    return result


def test_a_head_tied_to_the_embedding_of_the_same_stage_gets_each_use_once_under_zero_bubble() -> None:
    # Zero-bubble's W runs from each use of a parameter to that parameter: from the head's, it must not reach the
    # embedding's use of the same weight through the activations in between (the gradient would count it twice).
    got = run_ranks(train_in_one_stage, 1, "zero-bubble", timeout=120)[0]
    want = unsplit("gpt2")
    torch.testing.assert_close(got["losses"], want["losses"], atol=1e-5, rtol=1e-5)
    for name, value in want["state"].items():
        torch.testing.assert_close(got["params"][name], value, atol=1e-5, rtol=1e-5, msg=name)
