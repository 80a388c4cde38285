"""Hugging Face models as they are: captured by keyword, on the meta device, at any length up to their limit."""

from __future__ import annotations

import copy

import pytest
import torch
from support.hf import KINDS, LIMIT, Kind, batch, build

from stagewise.partition import CaptureError, auto, capture
from stagewise.pipeline import materialise_model
from stagewise.plan import workload


@pytest.mark.parametrize("kind", KINDS)
def test_a_model_built_on_meta_is_captured_by_keyword_and_runs_any_length_up_to_its_limit(kind: Kind) -> None:
    model = build(kind, meta=True)
    chain = capture(model, batch(2, 16, seed=0))
    assert len(chain.segments) == 4  # the embeddings, then one segment per block
    again = materialise_model(copy.deepcopy(chain), seed=3)
    materialise_model(chain, seed=3)
    assert not any(p.is_meta for p in model.parameters())
    for (name, mine), (_, theirs) in zip(chain.state_dict().items(), again.state_dict().items(), strict=True):
        assert torch.equal(mine, theirs), name  # the model's own initialiser, from the seed alone
    for length in (16, 9, 30):
        inputs = batch(3, length, seed=length)
        with torch.no_grad():
            expected = model(**inputs).logits
            got = chain(**inputs)
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
    with pytest.raises(ValueError, match=rf"input_ids of \w+ has size {LIMIT + 1} in dimension 1 .* runs sizes 2 to "):
        chain(**batch(2, LIMIT + 1, seed=1))
    with pytest.raises(
        ValueError, match=r"captured with the inputs \['input_ids', 'attention_mask'\], got \['input_ids'\]"
    ):
        chain(input_ids=batch(2, 8, seed=1)["input_ids"])


def test_the_gpt2_head_tied_to_its_embedding_stays_tied_under_both_names() -> None:
    chain = materialise_model(capture(build("gpt2", meta=True), batch(2, 16, seed=0)), seed=0)
    assert chain.lm_head.weight is chain.transformer.wte.weight
    keys = chain.state_dict()
    assert "transformer.wte.weight" in keys and "lm_head.weight" in keys
    assert float(keys["transformer.wte.weight"].std()) == pytest.approx(0.02, rel=0.1)  # GPT-2's own init


def test_an_output_the_model_does_not_return_or_an_initialiser_that_misses_a_tensor_is_refused() -> None:
    with pytest.raises(CaptureError, match=r"returns a CausalLMOutputWithPast with the entries \['logits'\], none "):
        capture(build("llama", meta=True), batch(2, 8, seed=0), output="hidden_states")
    fixed = capture(build("bert"), batch(2, 8, seed=0), dynamic_length=False)
    with pytest.raises(ValueError, match=r"has size 9 in dimension 1 .* runs sizes 8 there; capture the model with "):
        fixed(**batch(2, 9, seed=0))
    chain = capture(build("llama", meta=True), batch(2, 8, seed=0))
    with pytest.raises(
        TypeError, match=r"init\) gives \['model.embed_tokens.weight', 'model.rotary_emb.inv_freq'\] no value"
    ):
        materialise_model(chain, init=lambda module: None)


@pytest.mark.parametrize("kind", KINDS)
def test_a_slice_of_a_batch_is_taken_as_the_example_and_as_inputs(kind: Kind) -> None:
    # capture(model, {"input_ids": ids[:2, :-1]}) failed: "Constraints violated (length)", the slice's row stride
    # tying its free length to the whole row's.
    model = build(kind)
    whole = batch(4, 17, seed=0)
    sliced = {name: tensor[:2, :-1] for name, tensor in whole.items()}
    assert not sliced["input_ids"].is_contiguous()
    chain = capture(model, sliced)
    for inputs in (sliced, {name: tensor[:, 1:] for name, tensor in whole.items()}):  # both non-contiguous
        with torch.no_grad():
            expected = model(**{name: tensor.contiguous() for name, tensor in inputs.items()}).logits
            torch.testing.assert_close(chain(**inputs), expected, rtol=0, atol=0)
    assert auto(chain, 2, sliced).bounds[0] == 0 and len(auto(chain, 2, sliced).bounds) == 3
    planned = workload(chain, sliced, global_batch=8, tokens_per_sample=16)  # keywords, as capture takes them
    assert planned.profiled_batch == 2 and len(planned.costs) == len(chain.segments)
