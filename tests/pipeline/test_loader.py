"""StageLoader: disjoint shards per replica, the same samples in the same order on a replica's first and last stage."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import Dataset, DistributedSampler

from stagewise.pipeline import LoaderOptions, StageLoader
from stagewise.pipeline.loader import ShardOrder


class Numbered(Dataset[tuple[Any, torch.Tensor]]):
    """Sample i: inputs (i, -i as an int tensor), target 1000 + i; counts how often each field is read."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.reads = 0

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[Any, torch.Tensor]:
        self.reads += 1
        return (torch.tensor([float(i)]), torch.tensor(-i)), torch.tensor(1000.0 + i)


def loader(
    data: Dataset[Any], replica: int, *, first: bool, last: bool, shuffle: bool = True, **kw: Any
) -> StageLoader:
    sizes: dict[str, Any] = {"global_batch_size": 8, "dp": 2, "n_microbatches": 2} | kw
    options = LoaderOptions(shuffle=shuffle, seed=5)
    return StageLoader(data, replica=replica, first=first, last=last, options=options, **sizes)


def test_replicas_get_disjoint_shards_and_both_ends_of_a_replica_the_same_order() -> None:
    data = Numbered(42)
    seen: list[set[int]] = []
    for replica in range(2):
        firsts = list(loader(data, replica, first=True, last=False))
        lasts = list(loader(data, replica, first=False, last=True))
        assert len(firsts) == len(lasts) == 42 // 2 // 4 == 5
        order = []
        for a, b in zip(firsts, lasts, strict=True):
            assert a.targets is None and b.inputs is None
            x, ids = a.inputs  # a tuple of inputs stays a tuple
            assert x.shape == (4, 1) and ids.dtype == torch.int64
            assert torch.equal(ids, -x[:, 0].long())
            assert torch.equal(b.targets, 1000 + x[:, 0])  # the last stage's targets belong to the first's inputs
            order += x[:, 0].long().tolist()
        assert len(set(order)) == len(order) == 20
        seen.append(set(order))
    assert not seen[0] & seen[1]
    assert seen[0] | seen[1] <= set(range(42))


def test_middle_stages_load_nothing() -> None:
    data = Numbered(40)
    middle = loader(data, 1, first=False, last=False)
    batches = list(middle)
    assert len(batches) == 5 and all(b.inputs is None and b.targets is None for b in batches)
    assert data.reads == 0


def test_each_epoch_reshuffles_deterministically() -> None:
    data = Numbered(40)

    def epoch_order(epoch: int) -> list[int]:
        one = loader(data, 0, first=True, last=True)
        one.set_epoch(epoch)
        return [int(v) for b in one for v in b.inputs[0][:, 0]]

    assert epoch_order(0) == epoch_order(0)
    assert epoch_order(0) != epoch_order(1)
    assert sorted(epoch_order(0)) != epoch_order(0)  # shuffled
    unshuffled = loader(data, 0, first=True, last=False, shuffle=False)
    assert [int(v) for b in unshuffled for v in b.inputs[0][:, 0]] == list(range(0, 40, 2))


@pytest.mark.parametrize(
    ("options", "pattern"),
    [
        ({"global_batch_size": 9}, r"global_batch_size=9 is not divisible by dp=2; use a multiple of 2"),
        (
            {"global_batch_size": 6, "n_microbatches": 4},
            r"global_batch_size=6 is smaller than dp=2 x n_microbatches=4 = 8: each replica needs",
        ),
        ({"global_batch_size": 48}, r"the dataset's 40 samples give each of dp=2 replicas 20, fewer than one batch"),
    ],
)
def test_bad_batch_layouts_are_refused(options: dict[str, Any], pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        loader(Numbered(40), 0, first=True, last=True, **options)


def test_a_sample_that_is_not_a_pair_is_refused() -> None:
    class Bare(Dataset[torch.Tensor]):
        def __len__(self) -> int:
            return 8

        def __getitem__(self, i: int) -> torch.Tensor:
            return torch.zeros(2)

    with pytest.raises(TypeError, match=r"sample \d+ of the dataset is a Tensor, not an \(inputs, targets\) pair"):
        next(iter(loader(Bare(), 0, first=True, last=False)))


@settings(max_examples=60)
@given(
    size=st.integers(1, 300),
    replicas=st.integers(1, 5),
    seed=st.integers(0, 2**31),
    epoch=st.integers(0, 3),
    shuffle=st.booleans(),
    skip=st.integers(0, 40),
    data=st.data(),
)
def test_a_replicas_order_is_torchs_distributed_samplers(
    size: int, replicas: int, seed: int, epoch: int, shuffle: bool, skip: int, data: st.DataObject
) -> None:
    # The same batches as before for the same seed: DistributedSampler's order, without its lists of every index.
    replica = data.draw(st.integers(0, replicas - 1))
    dataset = list(range(size))
    torchs = DistributedSampler(
        dataset, num_replicas=replicas, rank=replica, shuffle=shuffle, seed=seed, drop_last=True
    )
    torchs.set_epoch(epoch)
    ours = ShardOrder(size, replicas, replica, shuffle=shuffle, seed=seed)
    ours.set_epoch(epoch)
    ours.skip = min(skip, len(torchs))
    assert list(ours) == list(torchs)[ours.skip :]
    assert len(ours) == len(torchs) - ours.skip
