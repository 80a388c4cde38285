"""Checkpoints across sharded layouts: saved with FSDP or tensor parallelism, loaded into any other layout or the
unsplit model (and weights of the unsplit model into any layout), the next step's loss is the same.

One launch of 4 gloo processes: every layout trains 2 steps, saves, and steps once more (the loss to match); then
each checkpoint is loaded into other layouts, which take that third step.
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from support.multiproc import run_ranks

from stagewise import checkpoint
from stagewise.comm import PipelineMesh, init_mesh
from stagewise.models.gpt import GPTConfig
from stagewise.models.gpt_parallel import plan as gpt_plan
from stagewise.partition import Partition
from stagewise.pipeline import Pipeline, PipelineOptions, load_pretrained

CONFIG = GPTConfig(vocab_size=64, seq_len=8, d_model=32, n_layers=4, n_heads=4, tie_embeddings=True)
BATCH = 8
SAVED_AT = 2


@dataclass(frozen=True)
class Layout:
    pp: int
    dp: int
    fsdp: int
    tp: int

    @property
    def name(self) -> str:
        return f"pp{self.pp}xdp{self.dp}xfsdp{self.fsdp}xtp{self.tp}"


A = Layout(2, 1, 2, 1)
B = Layout(2, 2, 1, 1)
C = Layout(1, 2, 1, 2)
D = Layout(1, 1, 2, 2)
LAYOUTS = (A, B, C, D)
MOVES = ((A, B), (B, A), (A, C), (C, D), (D, A))
"""Checkpoints loaded into another layout: pp2 x fsdp2 <-> pp2 x dp2 <-> tensor parallel, sharded or replicated."""


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(9)
    out = []
    for _ in range(SAVED_AT + 1):
        ids = torch.randint(0, CONFIG.vocab_size, (BATCH, CONFIG.seq_len), generator=g)
        out.append((ids, torch.roll(ids, -1, dims=1)))
    return out


MESHES: dict[Layout, PipelineMesh] = {}
"""One mesh per layout, kept for the job (see tests/pipeline/test_sharded.py)."""


@dataclass
class Trainer:
    pipe: Pipeline
    optimizer: torch.optim.Optimizer

    @classmethod
    def of(cls, layout: Layout) -> Trainer:
        if layout not in MESHES:
            MESHES[layout] = init_mesh(layout.pp, layout.dp, fsdp=layout.fsdp, tp=layout.tp, timeout=60)
        torch.manual_seed(3)
        bounds = (0, 3, 7) if layout.pp == 2 else (0, 7)
        pipe = Pipeline(
            CONFIG.build(device="meta"), Partition.from_bounds(bounds), n_microbatches=2,
            loss_fn=GPTConfig.loss, mesh=MESHES[layout],  # type: ignore[arg-type]
            options=PipelineOptions(tensor_parallel=gpt_plan),
        )  # fmt: skip
        return cls(pipe, torch.optim.AdamW(pipe.parameters(), lr=1e-3))

    def step(self, ids: torch.Tensor, targets: torch.Tensor) -> float:
        mesh = self.pipe.mesh
        mine = mesh.share(BATCH)
        self.optimizer.zero_grad()
        loss = self.pipe.step(ids[mine], targets[mine]).item()
        self.pipe.clip_grad_norm_(0.05)
        self.optimizer.step()
        return loss


def save_and_move(root: Path, exported: Path) -> dict[str, Any]:
    """Every layout's third-step loss, trained through and after each move; rank 0 exports A's checkpoint."""
    torch.set_num_threads(1)
    data = batches()
    out: dict[str, Any] = {}
    for layout in LAYOUTS:
        trainer = Trainer.of(layout)
        for ids, targets in data[:SAVED_AT]:
            trainer.step(ids, targets)
        checkpoint.save(root / layout.name, trainer.pipe, trainer.optimizer, checkpoint.Progress(SAVED_AT, 0, 0))
        out[layout.name] = trainer.step(*data[SAVED_AT])
        trainer.pipe.close()
    if dist.get_rank() == 0:
        checkpoint.export(root / A.name / f"step-{SAVED_AT:08d}", exported, format="safetensors")
    dist.barrier()
    moves = [*MOVES, (A, A)]
    for source, target in moves:
        key = f"{source.name}->{target.name}"
        try:
            trainer = Trainer.of(target)
            checkpoint.load(root / source.name / f"step-{SAVED_AT:08d}", trainer.pipe, trainer.optimizer)
            out[key] = trainer.step(*data[SAVED_AT])
            trainer.pipe.close()
        except Exception:  # reported by the move's own test
            out[key] = traceback.format_exc()
    for target in (D, B):  # the unsplit model's weights into a layout
        trainer = Trainer.of(target)
        load_pretrained(trainer.pipe, exported)
        out[f"unsplit->{target.name}"] = trainer.pipe.evaluate(*_mine(trainer, data[SAVED_AT])).item()
        trainer.pipe.close()
    dist.destroy_process_group()
    return out


def _mine(trainer: Trainer, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    mesh = trainer.pipe.mesh
    mine = mesh.share(BATCH)
    return batch[0][mine], batch[1][mine]


@pytest.fixture(scope="module")
def moved(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[int, dict[str, Any]], Path]:
    root = tmp_path_factory.mktemp("layouts")
    exported = root / "unsplit.safetensors"
    per_rank: dict[int, dict[str, Any]] = run_ranks(save_and_move, 4, root, exported, timeout=400)
    return per_rank, exported


def _agreed(per_rank: dict[int, dict[str, Any]], key: str) -> float:
    values = {rank: results[key] for rank, results in per_rank.items()}
    for rank, value in values.items():
        assert not isinstance(value, str), f"rank {rank}: {value}"
    assert len(set(values.values())) == 1, values  # every rank returns the global batch's loss
    return float(values[0])


def test_the_layouts_train_alike(moved: tuple[dict[int, dict[str, Any]], Path]) -> None:
    per_rank, _ = moved
    first = _agreed(per_rank, A.name)
    for layout in LAYOUTS[1:]:
        assert _agreed(per_rank, layout.name) == pytest.approx(first, abs=1e-5), layout


@pytest.mark.parametrize(("source", "target"), MOVES, ids=lambda layout: layout.name)
def test_a_checkpoint_continues_in_another_layout(
    moved: tuple[dict[int, dict[str, Any]], Path], source: Layout, target: Layout
) -> None:
    per_rank, _ = moved
    assert _agreed(per_rank, f"{source.name}->{target.name}") == pytest.approx(_agreed(per_rank, source.name), abs=1e-5)


def test_a_checkpoint_resumes_bit_identically_in_its_own_layout(
    moved: tuple[dict[int, dict[str, Any]], Path],
) -> None:
    per_rank, _ = moved
    assert _agreed(per_rank, f"{A.name}->{A.name}") == _agreed(per_rank, A.name)


def test_a_sharded_checkpoint_exports_to_the_unsplit_model_and_back(
    moved: tuple[dict[int, dict[str, Any]], Path],
) -> None:
    per_rank, exported = moved
    from safetensors.torch import load_file

    model = CONFIG.build()
    state = load_file(str(exported))
    model.load_state_dict(state)
    ids, targets = batches()[SAVED_AT]
    with torch.no_grad():
        unsplit = GPTConfig.loss(model(ids), targets).item()
    assert unsplit == pytest.approx(_agreed(per_rank, A.name), abs=1e-5)
    for target in (D, B):
        assert _agreed(per_rank, f"unsplit->{target.name}") == pytest.approx(unsplit, abs=1e-5), target
