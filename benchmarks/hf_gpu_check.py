"""One-device check of Hugging Face models as they are: GPT-2 (tied), Llama and BERT from configs, built on the meta
device, captured by keyword and trained by a Pipeline on one rank, against the unsplit model on the same device.

Runs on CUDA with NCCL when a GPU is visible (world size 1), else on the CPU with gloo. Each schedule trains
``--steps`` SGD steps on batches of three lengths (the capture's and two others); interleaved puts two stages on
the one rank. One JSON line per model and schedule, with the largest difference in loss and parameters:

    python benchmarks/hf_gpu_check.py [--steps 3] [--layers 4]
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import torch
import torch.nn.functional as F
import transformers

from stagewise.comm import init_mesh, launch
from stagewise.partition import Partition, capture
from stagewise.pipeline import Pipeline, PipelineOptions, materialise_model

SEED = 5
LENGTHS = (64, 48, 96)
BATCH = 7
TOLERANCE = 1e-5
KINDS = ("gpt2", "llama", "bert")
SCHEDULES = ("1f1b", "gpipe", "zero-bubble", "interleaved-1f1b")


def _build(kind: str, layers: int) -> torch.nn.Module:
    if kind == "gpt2":
        config: Any = transformers.GPT2Config(
            n_layer=layers, n_embd=256, n_head=4, vocab_size=1000, n_positions=128, tie_word_embeddings=True,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
        )  # fmt: skip
        cls: Any = transformers.GPT2LMHeadModel
    elif kind == "llama":
        config = transformers.LlamaConfig(
            num_hidden_layers=layers, hidden_size=256, intermediate_size=512, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=1000, max_position_embeddings=128, bos_token_id=0, eos_token_id=0,
        )  # fmt: skip
        cls = transformers.LlamaForCausalLM
    else:
        config = transformers.BertConfig(
            num_hidden_layers=layers, hidden_size=256, intermediate_size=512, num_attention_heads=4,
            vocab_size=1000, max_position_embeddings=128, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        )  # fmt: skip
        cls = transformers.BertForMaskedLM
    with torch.device("meta"):
        return cls(config).train()  # type: ignore[no-any-return]


def _batches(device: torch.device) -> list[tuple[dict[str, torch.Tensor], torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    out = []
    for length in LENGTHS:
        ids = torch.randint(1, 1000, (BATCH, length), generator=g)
        mask = torch.ones_like(ids)
        mask[0, length // 2 :] = 0
        out.append(
            ({"input_ids": ids.to(device), "attention_mask": mask.to(device)}, torch.roll(ids, -1, 1).to(device))
        )
    return out


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def _unsplit(kind: str, layers: int, device: torch.device, steps: int) -> dict[str, Any]:
    model = _build(kind, layers)
    materialise_model(capture(model, _batches(torch.device("meta"))[0][0]), device=device, seed=SEED)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for inputs, targets in _batches(device)[:steps]:
        opt.zero_grad()
        loss = _loss(model(**inputs).logits, targets)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return {"losses": losses, "params": {k: v.detach().cpu() for k, v in model.state_dict().items()}}


def check(steps: int, layers: int) -> list[dict[str, Any]]:
    transformers.logging.set_verbosity_error()
    mesh = init_mesh(1)  # NCCL on the GPU when one is visible, else gloo on the CPU
    device = mesh.device
    rows = []
    for kind in KINDS:
        want = _unsplit(kind, layers, device, steps)
        for schedule in SCHEDULES:
            chain = capture(_build(kind, layers), _batches(torch.device("meta"))[0][0])
            n = len(chain.segments)
            virtual = 2 if schedule == "interleaved-1f1b" else 1
            bounds = (0, n // 2, n) if virtual == 2 else (0, n)
            pipe = Pipeline(
                chain, Partition.from_bounds(bounds), schedule=schedule, n_microbatches=4 if virtual == 2 else 3,
                loss_fn=_loss, mesh=mesh, options=PipelineOptions(seed=SEED, n_virtual=virtual),
            )  # fmt: skip
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            opt = torch.optim.SGD(pipe.parameters(), lr=0.5)
            losses = []
            for inputs, targets in _batches(device)[:steps]:
                opt.zero_grad()
                losses.append(pipe.step(inputs, targets).item())
                opt.step()
            got = {k: v.detach().cpu() for k, v in pipe.state_dict().items()}
            loss_diff = max(abs(a - b) for a, b in zip(losses, want["losses"], strict=True))
            param_diff = max(float((got[k] - v).abs().max()) for k, v in want["params"].items())
            rows.append({
                "model": kind, "schedule": schedule, "device": str(device), "steps": steps,
                "max_loss_diff": loss_diff, "max_param_diff": param_diff,
                "equal": loss_diff <= TOLERANCE and param_diff <= TOLERANCE,
                "peak_mib": torch.cuda.max_memory_allocated() / 2**20 if device.type == "cuda" else None,
            })  # fmt: skip
            pipe.close()
    torch.distributed.destroy_process_group()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--layers", type=int, default=4)
    ns = parser.parse_args()
    device = "auto" if torch.cuda.is_available() else "cpu"
    for row in launch(check, 1, ns.steps, ns.layers, device=device)[0]:
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
