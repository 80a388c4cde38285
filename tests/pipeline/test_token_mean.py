"""Loss(reduction="tokens"): padded batches train as Hugging Face's mean over the valid tokens of the global batch,
with targets given shifted or as Hugging Face's labels (shifted by the loss), and on packed documents."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from support.multiproc import run_ranks

from stagewise.comm import init_mesh
from stagewise.models import GPT, GPTConfig, preset
from stagewise.partition import Partition
from stagewise.pipeline import Compute, Loss, Pipeline, PipelineOptions, SelectiveCheckpointing, materialise_model
from stagewise.pipeline.loss.microbatch import split
from stagewise.pipeline.loss.tokens import check_tokens, per_token, valid_tokens
from stagewise.run.objective import objective

CONFIG = GPTConfig(vocab_size=32, seq_len=8, d_model=16, n_layers=2, n_heads=2)
BOUNDS = (0, 2, 5)  # embed, blocks.0 | blocks.1, norm, head
STEPS = 3
M = 3
LR = 0.5
SEED = 5
IGNORE = -100


@dataclass(frozen=True)
class TokenCase:
    """One pipeline trained on padded batches: its schedule, each replica's samples per step, its targets' form."""

    schedule: str
    replica_batches: tuple[int, ...]
    """Samples of each replica's batch (their sum is the global batch); 7 splits into micro-batches of 3, 2, 2."""
    tuple_targets: bool = False
    """Pass the targets as (token ids, a float tensor): the first one is counted."""
    seed: int = 0
    checkpointing: bool | SelectiveCheckpointing = False
    """The stages' activation checkpointing: none, whole layers, or selective (the matmuls' outputs kept)."""
    form: Literal["shifted", "labels", "packed"] = "shifted"
    """The targets are each position's next token ("shifted"); Hugging Face's labels, the inputs themselves,
    which the loss shifts (``shift_labels``); or "shifted" on packed documents: the inputs are (ids, each
    token's position in its document), and no target crosses a document's end."""

    @property
    def global_batch(self) -> int:
        return sum(self.replica_batches)


def padded_batches(case: TokenCase) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each step's global batch (inputs, targets): every sample is padded (-100) after its own number of valid
    targets, from none to all; step 1's last replica gets padding alone (its count is 0, the global one is not)."""
    g = torch.Generator().manual_seed(100 + case.seed)
    out = []
    for step in range(STEPS):
        ids = torch.randint(0, CONFIG.vocab_size, (case.global_batch, CONFIG.seq_len + 1), generator=g)
        inputs, targets = ids[:, :-1].clone(), ids[:, 1:].clone()
        valid = torch.randint(0, CONFIG.seq_len + 1, (case.global_batch,), generator=g)
        valid[0], valid[-2] = CONFIG.seq_len, 0  # one full sample, one without any valid target
        if step == 1 and len(case.replica_batches) > 1:
            valid[-case.replica_batches[-1] :] = 0
        targets[torch.arange(CONFIG.seq_len) >= valid[:, None]] = IGNORE
        if case.form == "labels":  # the inputs, padded as the targets are: label t + 1 is target t
            targets = torch.cat([inputs[:, :1], targets[:, :-1]], dim=1)
        if case.form == "packed":
            out.append(_packed(inputs, targets, g))
            continue
        out.append((inputs, targets))
    return out


def _packed(ids: torch.Tensor, targets: torch.Tensor, g: torch.Generator) -> tuple[Any, torch.Tensor]:
    """``ids`` as packed documents: each row cut into documents where a random draw says, positions restarting
    at each, and no target across a document's end."""
    starts = torch.rand(ids.shape, generator=g) < 0.3
    starts[:, 0] = True
    index = torch.arange(ids.shape[1]).expand_as(ids)
    first = torch.where(starts, index, 0).cummax(dim=1).values
    positions = index - first
    ends = torch.zeros_like(starts)
    ends[:, :-1] = starts[:, 1:]
    return (ids, positions), targets.masked_fill(ends, IGNORE)


def eval_batch(case: TokenCase) -> tuple[Any, torch.Tensor]:
    return padded_batches(TokenCase(case.schedule, case.replica_batches, seed=case.seed + 50, form=case.form))[0]


def forward(model: Any, inputs: Any) -> torch.Tensor:
    """The unsplit model on ``inputs``: ids, or packed documents."""
    out: torch.Tensor = model(*inputs) if isinstance(inputs, tuple) else model(inputs)
    return out


def reference_loss(case: TokenCase, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Hugging Face's loss; for labels, shifted as ``ForCausalLMLoss`` shifts them."""
    if case.form == "labels":
        return hf_loss(logits[:, :-1], targets[:, 1:])
    return hf_loss(logits, targets)


def hf_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The reference: Hugging Face's causal-LM loss, the mean over the valid tokens of the batch."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE)


def summed_loss(logits: torch.Tensor, targets: Any) -> torch.Tensor:
    """What the pipeline's loss_fn returns: the micro-batch's per-token losses, summed."""
    ids = targets[0] if isinstance(targets, tuple) else targets
    return F.cross_entropy(logits.flatten(0, 1), ids.flatten(), ignore_index=IGNORE, reduction="sum")


def summed_label_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The same for Hugging Face's labels: shifted here, inside the loss."""
    return summed_loss(logits[:, :-1], labels[:, 1:])


def unsplit(case: TokenCase) -> dict[str, Any]:
    """One process, the whole model, the whole global batch of each step."""
    model = materialise_model(GPT(CONFIG, device="meta"), seed=SEED)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses, grads = [], []
    for x, y in padded_batches(case):
        opt.zero_grad()
        loss = reference_loss(case, forward(model, x), y)
        loss.backward()
        losses.append(loss.item())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        opt.step()
    with torch.no_grad():
        x, y = eval_batch(case)
        evaluated = reference_loss(case, forward(model, x), y).item()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"losses": losses, "grads": grads, "params": params, "eval": evaluated}


def _share(case: TokenCase, replica: int, batch: Any) -> Any:
    start = sum(case.replica_batches[:replica])
    if isinstance(batch, tuple):
        return tuple(t[start : start + case.replica_batches[replica]] for t in batch)
    return batch[start : start + case.replica_batches[replica]]


def train_tokens(cases: list[TokenCase], pp: int, dp: int) -> dict[str, Any]:
    """Every case on this rank's pipeline; then a global batch of padding alone, refused on every rank."""
    torch.set_num_threads(1)
    mesh = init_mesh(pp, dp, timeout=30)
    results: dict[str, Any] = {"cases": []}
    for case in cases:
        labels = case.form == "labels"
        options = PipelineOptions(
            seed=SEED,
            loss=Loss(reduction="tokens", ignore_index=IGNORE, shift_labels=labels),
            compute=Compute(activation_checkpointing=case.checkpointing),
        )
        pipe = Pipeline(
            GPT(CONFIG, device="meta"), Partition.from_bounds(BOUNDS), schedule=case.schedule,  # type: ignore[arg-type]
            n_microbatches=M, loss_fn=summed_label_loss if labels else summed_loss, mesh=mesh, options=options,
        )  # fmt: skip
        opt = torch.optim.SGD(pipe.parameters(), lr=LR)
        losses, grads = [], []
        for x, y in padded_batches(case):
            x, y = _share(case, mesh.replica, x), _share(case, mesh.replica, y)
            targets = (y, torch.rand(len(y))) if case.tuple_targets else y
            opt.zero_grad()
            losses.append(pipe.step(x, targets).item())
            grads.append({n: p.grad.clone() for n, p in pipe.named_parameters() if p.grad is not None})
            opt.step()
        x, y = (_share(case, mesh.replica, t) for t in eval_batch(case))
        evaluated = pipe.evaluate(x, y).item()
        params = {n: p.detach().clone() for n, p in pipe.named_parameters()}
        results["cases"].append({"losses": losses, "grads": grads, "params": params, "eval": evaluated})
        if case is cases[-1]:
            results["refusals"] = _padding_alone(pipe, x)
        pipe.close()
    dist.destroy_process_group()
    return results


def _padding_alone(pipe: Pipeline, x: torch.Tensor) -> list[str]:
    """What step() and evaluate() say of a batch whose every target is padding, on this rank."""
    refusals = []
    for run in (pipe.step, pipe.evaluate):
        try:
            run(x, torch.full_like(x, IGNORE))
        except ValueError as err:
            refusals.append(str(err))
    return refusals


def _same(got: list[dict[str, torch.Tensor]], want: dict[str, torch.Tensor], what: str) -> None:
    """Each rank's tensors equal the reference's of their names, and the ranks hold all of its names together."""
    assert {n for one in got for n in one} == want.keys(), what
    for one in got:
        for name, value in one.items():
            torch.testing.assert_close(value, want[name], atol=1e-5, rtol=0, msg=f"{what}: {name}")


def check(results: dict[int, dict[str, Any]], cases: list[TokenCase]) -> None:
    """Every rank's losses, gradients at each step and parameters after the steps equal the unsplit model's; every
    rank refused the batch of padding alone, in step() and in evaluate()."""
    for i, case in enumerate(cases):
        want = unsplit(case)
        got = [r["cases"][i] for r in results.values()]
        for one in got:
            torch.testing.assert_close(one["losses"], want["losses"], atol=1e-5, rtol=0)
            assert one["eval"] == pytest.approx(want["eval"], abs=1e-5)
        for step in range(STEPS):
            _same([one["grads"][step] for one in got], want["grads"][step], f"{case}, gradients at step {step}")
        _same([one["params"] for one in got], want["params"], f"{case}, parameters after {STEPS} steps")
    for rank, result in results.items():
        refusals = result["refusals"]
        assert len(refusals) == 2, (rank, refusals)
        assert all("no valid target tokens (every target is ignore_index=-100" in r for r in refusals), refusals


def test_token_mean_on_two_stages_equals_the_unsplit_model() -> None:
    """pp=2 dp=1, batches of 7 in micro-batches of 3, 2, 2: the targets a tensor and a tuple, Hugging Face's labels,
    and packed documents."""
    cases = [
        TokenCase("1f1b", (7,), form="labels", seed=6),
        TokenCase("1f1b", (7,), form="packed", seed=7, checkpointing=SelectiveCheckpointing()),
        TokenCase("1f1b", (7,)),
        TokenCase("zero-bubble", (7,), tuple_targets=True, seed=1),
    ]
    check(run_ranks(train_tokens, 2, cases, 2, 1, timeout=120), cases)


def test_token_mean_on_two_stages_by_two_replicas_equals_the_unsplit_model() -> None:
    """pp=2 dp=2: replicas of 7 and 7 samples, and of 7 and 5 (sizes a token mean allows to differ), the second
    as Hugging Face's labels."""
    cases = [
        TokenCase("1f1b", (7, 7), seed=2, checkpointing=SelectiveCheckpointing()),
        TokenCase("gpipe", (7, 5), seed=3, form="labels", checkpointing=True),
    ]
    check(run_ranks(train_tokens, 4, cases, 2, 2, timeout=150), cases)


# --- one process --------------------------------------------------------------------------------------------------


def test_the_padded_batches_tell_a_token_mean_from_a_sample_weighted_one() -> None:
    """The data can fail the tests above: weighting micro-batches by their samples gives another loss."""
    logits = torch.randn(7, CONFIG.seq_len, CONFIG.vocab_size, generator=torch.Generator().manual_seed(0))
    _, targets = padded_batches(TokenCase("1f1b", (7,)))[0]
    by_samples = sum(
        len(t) / 7 * hf_loss(lg, t) for lg, t in zip(logits.tensor_split(M), targets.tensor_split(M), strict=True)
    )
    parts = per_token(split(targets, M, what="targets", reduction="tokens"), valid_tokens(targets, IGNORE))
    by_tokens = sum(
        w * summed_loss(lg, t) for w, lg, t in zip(parts.weights, logits.tensor_split(M), parts.parts, strict=True)
    )
    assert parts.tokens == int((targets != IGNORE).sum()) and parts.sizes == (3, 2, 2)
    torch.testing.assert_close(by_tokens, hf_loss(logits, targets), atol=1e-6, rtol=0)
    # Far off, or NaN where a micro-batch holds padding alone (a mean over none of its tokens).
    assert not torch.isclose(torch.as_tensor(by_samples), hf_loss(logits, targets), atol=1e-2, rtol=0)


def test_options_refuse_an_unknown_reduction_and_a_non_integer_ignore_index() -> None:
    with pytest.raises(ValueError, match=r"Loss.reduction must be 'mean', 'sum' or 'tokens', got 'token'; 'tokens'"):
        Loss(reduction="token")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"Loss.ignore_index must be a whole number, got -100.0"):
        Loss(reduction="tokens", ignore_index=-100.0)  # type: ignore[arg-type]


def test_counting_takes_the_first_target_tensor_and_refuses_float_targets_and_no_tokens() -> None:
    ids = torch.tensor([[1, 2, IGNORE], [IGNORE, IGNORE, IGNORE]])
    assert valid_tokens(ids, IGNORE) == 2
    assert valid_tokens((ids, torch.zeros(2, 3)), IGNORE) == 2
    assert valid_tokens(ids, 1) == 5
    with pytest.raises(ValueError, match=r"first target tensor, which must hold integer class ids, but it is "):
        valid_tokens((torch.zeros(2, 3), ids), IGNORE)
    with pytest.raises(ValueError, match=r"^the global batch has no valid target tokens .* ignore_index=-100"):
        check_tokens(0, IGNORE)
    check_tokens(1, IGNORE)
    assert per_token(split(ids, 2, what="targets", reduction="tokens"), 0).weights == (0.0, 0.0)


def test_the_language_model_presets_train_on_the_token_mean_which_is_the_mean_on_unpadded_text() -> None:
    goal, model = objective(preset("gpt-tiny")), preset("gpt-tiny")
    assert goal.reduction == "tokens" and goal.ignore_index == IGNORE
    assert objective(preset("mlp-tiny")).reduction == "mean"
    g = torch.Generator().manual_seed(0)
    logits, targets = torch.randn(2, 5, 256, generator=g), torch.randint(0, 256, (2, 5), generator=g)
    torch.testing.assert_close(goal.loss_fn(logits, targets) / targets.numel(), model.loss(logits, targets))


def test_hugging_face_labels_are_counted_after_each_samples_first_and_a_miscount_would_show() -> None:
    case = TokenCase("1f1b", (7,), form="labels", seed=6)
    (x, labels), (_, shifted) = padded_batches(case)[0], padded_batches(TokenCase("1f1b", (7,), seed=6))[0]
    assert torch.equal(labels[:, 1:], shifted[:, :-1]) and torch.equal(labels[:, 0], x[:, 0])
    assert valid_tokens(labels, IGNORE, shift_labels=True) == valid_tokens(shifted[:, :-1], IGNORE)
    assert valid_tokens(labels, IGNORE) == valid_tokens(shifted[:, :-1], IGNORE) + 7  # one more per sample
    with pytest.raises(ValueError, match=r"shift_labels counts each sample's labels after its first, but the first"):
        valid_tokens(torch.tensor([1, 2, 3]), IGNORE, shift_labels=True)
    with pytest.raises(TypeError, match=r"Loss.shift_labels must be True or False, got 'yes'"):
        Loss(shift_labels="yes")  # type: ignore[arg-type]
