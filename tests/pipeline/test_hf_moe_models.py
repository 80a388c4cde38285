"""Hugging Face mixture-of-experts models (Mixtral, Qwen2-MoE, Qwen3-MoE), built from tiny configs on the meta
device, train in a pipeline of 2 gloo processes as the unsplit model; the experts implementation torch.export
cannot capture is refused by name."""

from __future__ import annotations

import copy
import functools
import logging
from dataclasses import dataclass
from typing import Any, Literal

import pytest
import torch
import torch.distributed as dist
import transformers
from support.hf import batch, lm_loss, steps, train_pipeline, train_unsplit
from support.multiproc import run_ranks
from torch import nn

from stagewise.comm import init_mesh
from stagewise.partition import CaptureError, Partition, capture
from stagewise.pipeline import Pipeline, PipelineOptions, materialise_model

transformers.logging.set_verbosity_error()

MoeKind = Literal["mixtral", "qwen2-moe", "qwen3-moe"]
MOE_KINDS: tuple[MoeKind, ...] = ("mixtral", "qwen2-moe", "qwen3-moe")
VOCAB = 96  # support.hf.batch draws token ids below it
STEPS = 3
BATCH = 7  # 3 micro-batches of 3, 2 and 2 samples
MICRO = 3
LENGTHS = (16, 12, 20)
"""Captured at the first length; the steps run at each."""
SEED = 5


@dataclass(frozen=True)
class Case:
    """One model trained in the pipeline: its kind, its experts implementation (None: transformers' default, as a
    user builds it), the schedule, and whether its config asks for the router's load-balancing loss."""

    kind: MoeKind
    experts: str | None
    schedule: str
    aux_loss: bool = False

    @property
    def name(self) -> str:
        aux = " aux" if self.aux_loss else ""
        return f"{self.kind} {self.experts or 'default'} {self.schedule}{aux}"


CASES = (
    Case("mixtral", None, "1f1b"),
    Case("qwen2-moe", None, "1f1b"),  # a shared expert beside the routed ones
    Case("qwen3-moe", None, "zero-bubble", aux_loss=True),  # the backward split in two through the experts' op
    Case("mixtral", "batched_mm", "1f1b"),
)


def build(kind: MoeKind, *, experts: str | None = None, aux_loss: bool = False, meta: bool = True) -> nn.Module:
    """A 3-layer causal LM of ``kind`` with 4 experts, 2 per token (``experts``: its experts implementation)."""
    common: dict[str, Any] = dict(
        num_hidden_layers=3, hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=VOCAB, max_position_embeddings=48, bos_token_id=0, eos_token_id=0, num_experts_per_tok=2,
        output_router_logits=aux_loss,
    )  # fmt: skip
    if experts is not None:
        common["experts_implementation"] = experts
    cls: type[nn.Module]
    if kind == "mixtral":
        cls, config = transformers.MixtralForCausalLM, transformers.MixtralConfig(num_local_experts=4, **common)
    elif kind == "qwen2-moe":
        cls = transformers.Qwen2MoeForCausalLM
        config = transformers.Qwen2MoeConfig(
            num_experts=4, moe_intermediate_size=24, shared_expert_intermediate_size=32, **common
        )
    else:
        cls = transformers.Qwen3MoeForCausalLM
        config = transformers.Qwen3MoeConfig(num_experts=4, moe_intermediate_size=24, head_dim=8, **common)
    if meta:
        with torch.device("meta"):
            return cls(config).train()
    return cls(config).train()


def bounds(n: int) -> tuple[int, ...]:
    """Two stages: the embedding and the first block, then the other two blocks and the head."""
    return (0, 2, n)


@functools.cache
def unsplit(case: Case) -> dict[str, Any]:
    """The model itself (not its capture), initialised as the pipeline's layers are, trained on whole batches on
    the loss the pipeline trains: the language model's."""
    model = build(case.kind, experts=case.experts, aux_loss=case.aux_loss)
    materialise_model(capture(model, batch(MICRO, LENGTHS[0], seed=0)), seed=SEED)
    return train_unsplit(model, steps(BATCH, LENGTHS), lr=0.5)


def train_every_case() -> dict[str, Any]:
    torch.set_num_threads(1)
    mesh = init_mesh(2, timeout=60)
    results: dict[str, Any] = {}
    for case in CASES:
        chain = capture(build(case.kind, experts=case.experts, aux_loss=case.aux_loss), batch(MICRO, 16, seed=0))
        pipe = Pipeline(
            copy.deepcopy(chain), Partition.from_bounds(bounds(len(chain.segments))), schedule=case.schedule,
            n_microbatches=MICRO, loss_fn=lm_loss, mesh=mesh, options=PipelineOptions(seed=SEED),
        )  # fmt: skip
        results[case.name] = train_pipeline(pipe, steps(BATCH, LENGTHS), lr=0.5)
        pipe.close()
    dist.destroy_process_group()
    return results


@pytest.fixture(scope="module")
def trained() -> dict[int, dict[str, Any]]:
    """Every case trained in one launch of 2 processes."""
    return run_ranks(train_every_case, 2, timeout=240)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_a_hugging_face_moe_model_trains_in_the_pipeline_as_the_unsplit_model(
    trained: dict[int, dict[str, Any]], case: Case
) -> None:
    want = unsplit(case)
    merged: dict[str, torch.Tensor] = {}
    for got in trained.values():
        torch.testing.assert_close(got[case.name]["losses"], want["losses"], atol=1e-5, rtol=1e-5)
        merged.update(got[case.name]["params"])
    assert sorted(merged) == sorted(want["state"])
    experts = [name for name in want["state"] if ".experts." in name]
    assert experts, "the model has routed experts"
    for name, value in want["state"].items():
        torch.testing.assert_close(merged[name], value, atol=1e-5, rtol=1e-5, msg=name)


@pytest.mark.parametrize("kind", MOE_KINDS)
def test_the_eager_experts_implementation_is_refused_with_the_one_to_choose(kind: MoeKind) -> None:
    model = build(kind, experts="eager")
    with pytest.raises(CaptureError, match=r"'eager' experts implementation") as raised:
        capture(model, batch(2, 8, seed=0))
    message = str(raised.value)
    assert "\n" not in message
    assert type(model).__name__ in message and "experts_implementation='grouped_mm'" in message
    assert type(model.get_submodule("model.layers.0.mlp.experts")).__name__ in message


def test_torch_export_indeed_cannot_capture_the_eager_experts() -> None:
    # The refusal above is made before exporting; this is what torch.export itself does with that implementation
    # (when this starts to pass, the refusal is out of date).
    model = build("mixtral", experts="eager", meta=False)
    model.config.use_cache = False
    ids = batch(2, 8, seed=0)["input_ids"]
    with pytest.raises(Exception, match="data-dependent"):
        torch.export.export(model, (), {"input_ids": ids})


def test_the_load_balancing_loss_is_left_out_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    model = build("mixtral", aux_loss=True, meta=False)
    inputs = batch(2, 8, seed=0)
    with caplog.at_level(logging.WARNING, logger="stagewise"):
        chain = capture(model, inputs)
    warned = [r.getMessage() for r in caplog.records if "load-balancing" in r.getMessage()]
    assert len(warned) == 1 and "MixtralForCausalLM" in warned[0] and "output_router_logits=True" in warned[0]
    assert model.config.output_router_logits is True  # restored after the capture
    out = model(**inputs)
    assert out.aux_loss is not None  # the model itself still computes it
    torch.testing.assert_close(chain(**inputs), out.logits)
    plain = capture(build("mixtral", meta=False), inputs)  # no router logits passed from segment to segment
    assert [s.graph.emits for s in chain.segments] == [s.graph.emits for s in plain.segments]


def test_the_default_experts_implementation_is_one_torch_export_captures() -> None:
    model = build("qwen3-moe", meta=False)
    assert model.config._experts_implementation == "grouped_mm"
    inputs = batch(2, 8, seed=0)
    torch.testing.assert_close(capture(model, inputs)(**inputs), model(**inputs).logits)
