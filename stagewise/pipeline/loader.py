"""Each rank's batches: its replica's share of each epoch's order, inputs on the first stage, targets on the last."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler, default_collate

from stagewise.comm.payload import Payload

if TYPE_CHECKING:
    from stagewise.pipeline.pipe import Pipeline

Field = Literal["inputs", "targets"]
"""What a rank loads of each sample: the first stage needs inputs, the last targets."""


@dataclass(frozen=True)
class Batch:
    """One step's data for this rank: None for what it does not need."""

    inputs: Payload | None
    targets: Payload | None


class _Fields(Dataset[tuple[Any, ...]]):
    """A view of a dataset of (inputs, targets) samples that keeps only the fields one rank needs."""

    def __init__(self, dataset: Dataset[Any], fields: Sequence[Field]) -> None:
        self.dataset = dataset
        self.columns = [0 if f == "inputs" else 1 for f in fields]

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, index: int) -> tuple[Any, ...]:
        sample = self.dataset[index]
        if not isinstance(sample, (tuple, list)) or len(sample) != 2:
            raise TypeError(
                f"sample {index} of the dataset is a {type(sample).__name__}, not an (inputs, targets) pair; "
                "make the dataset return (inputs, targets)"
            )
        return tuple(sample[c] for c in self.columns)


class ShardOrder(Sampler[int]):
    """The samples one replica takes in an epoch, in order, from sample :attr:`skip` on.

    The order is torch's ``DistributedSampler``'s with ``drop_last`` (the
    permutation drawn from ``seed + epoch``, or the dataset's order, cut to a
    multiple of the replicas and dealt out in turn), so the same seed gives the
    same batches. It is held as one int64 array and handed out a chunk at a
    time: ``DistributedSampler`` builds Python lists of every index, about
    100 bytes a sample (1.4 GiB of resident memory for the 8 million windows of
    a 2 GiB token file). Resuming at :attr:`skip` starts there at once.
    """

    CHUNK = 4096

    def __init__(self, size: int, replicas: int, replica: int, *, shuffle: bool, seed: int) -> None:
        self.size = size
        self.replicas = replicas
        self.replica = replica
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.skip = 0
        """Samples of the epoch to leave out at its start (a resume in the middle of an epoch)."""
        self.per_replica = size // replicas

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def order(self) -> np.ndarray:
        """This replica's samples of the epoch, all of them, as indices into the dataset: host memory of its own
        (numpy's), apart from the tensors training holds."""
        if self.shuffle:
            generator = torch.Generator()
            generator.manual_seed(self.seed + self.epoch)
            every: np.ndarray = torch.randperm(self.size, generator=generator).numpy().copy()
        else:
            every = np.arange(self.size)
        return every[self.replica : self.per_replica * self.replicas : self.replicas]

    def __iter__(self) -> Iterator[int]:
        mine = self.order()
        for start in range(self.skip, len(mine), self.CHUNK):
            yield from mine[start : start + self.CHUNK].tolist()

    def __len__(self) -> int:
        return self.per_replica - self.skip


def _collate(samples: list[tuple[Any, ...]]) -> tuple[Payload, ...]:
    columns = default_collate(samples)
    return tuple(tuple(c) if isinstance(c, list) else c for c in columns)


@dataclass(frozen=True)
class LoaderOptions:
    """How a :class:`StageLoader` draws and assembles its samples; the defaults suit a training split."""

    shuffle: bool = True
    """Reshuffle each epoch (deterministically from ``seed`` and the epoch); False keeps the dataset's order."""
    seed: int = 0
    """Seed of the shuffle, the same on every rank."""
    num_workers: int = 0
    """DataLoader worker processes per loading rank."""
    pin_memory: bool | None = None
    """Page-locked batches for faster copies to a GPU; None: when CUDA is available."""
    collate_fn: Callable[[list[tuple[Any, ...]]], tuple[Payload, ...]] | None = None
    """How samples become a batch; None: torch's default collation, tuples kept as tuples."""


class StageLoader:
    """The batches one rank of a pipeline x data-parallel job needs, step by step.

    Replica ``r`` of ``dp`` draws its samples with a :class:`DistributedSampler`
    (shard ``r``, the same seed everywhere, reshuffled per epoch by
    :meth:`set_epoch`), so the replicas' shards are disjoint and the first and
    the last stage of one replica see the same samples in the same order. The
    first stage loads only each sample's inputs and the last only its targets;
    a rank in the middle loads nothing and yields ``Batch(None, None)`` as many
    times. Every batch has exactly ``global_batch_size / dp`` samples (the
    remainder of an epoch is dropped), so the replicas' losses weigh equally.

    Args:
        dataset: a map-style dataset whose samples are ``(inputs, targets)``.
        global_batch_size: samples per step over all replicas.
        dp: data-parallel replicas; ``replica``: this rank's.
        first: this rank holds the first stage; ``last``: the last stage.
        n_microbatches: micro-batches per step; each replica's batch must hold at least this many samples.
        options: shuffling, worker processes, pinning and collation (:class:`LoaderOptions`).
    """

    def __init__(
        self,
        dataset: Dataset[Any],
        *,
        global_batch_size: int,
        dp: int,
        replica: int,
        first: bool,
        last: bool,
        n_microbatches: int = 1,
        options: LoaderOptions | None = None,
    ) -> None:
        options = options or LoaderOptions()
        if global_batch_size % dp:
            raise ValueError(
                f"global_batch_size={global_batch_size} is not divisible by dp={dp}; "
                f"use a multiple of {dp}, such as {dp * max(1, round(global_batch_size / dp))}"
            )
        local = global_batch_size // dp
        if local < n_microbatches:
            raise ValueError(
                f"global_batch_size={global_batch_size} is smaller than dp={dp} x n_microbatches={n_microbatches} "
                f"= {dp * n_microbatches}: each replica needs at least one sample per micro-batch; "
                f"use a global batch of at least {dp * n_microbatches} or fewer micro-batches"
            )
        self.local_batch_size = local
        self.sampler = ShardOrder(
            len(dataset),  # type: ignore[arg-type]
            dp,
            replica,
            shuffle=options.shuffle,
            seed=options.seed,
        )
        self.steps_per_epoch = len(self.sampler) // local
        self.start = 0
        """The batch of the epoch that iteration starts from."""
        if self.steps_per_epoch == 0:
            raise ValueError(
                f"the dataset's {len(dataset)} samples give each of dp={dp} replicas "  # type: ignore[arg-type]
                f"{len(self.sampler)}, fewer than one batch of {local}; use a larger dataset or a smaller batch"
            )
        wants: tuple[tuple[Field, bool], ...] = (("inputs", first), ("targets", last))
        self.fields: list[Field] = [f for f, wanted in wants if wanted]
        self.loader: DataLoader[tuple[Any, ...]] | None = None
        if self.fields:
            self.loader = DataLoader(
                _Fields(dataset, self.fields),
                batch_size=local,
                sampler=self.sampler,
                drop_last=True,
                num_workers=options.num_workers,
                pin_memory=torch.cuda.is_available() if options.pin_memory is None else options.pin_memory,
                persistent_workers=options.num_workers > 0,
                collate_fn=options.collate_fn or _collate,
            )

    @classmethod
    def of(
        cls, pipe: Pipeline, dataset: Dataset[Any], *, global_batch_size: int, options: LoaderOptions | None = None
    ) -> StageLoader:
        """The loader for this rank of ``pipe``: its replica, and whether it holds the first or last stage."""
        mesh = pipe.mesh
        return cls(
            dataset,
            global_batch_size=global_batch_size,
            dp=mesh.layout.batch_shards,
            replica=mesh.batch_index,
            first=pipe.is_first,
            last=pipe.is_last,
            n_microbatches=pipe.n_microbatches,
            options=options,
        )

    def set_epoch(self, epoch: int, *, start: int = 0) -> None:
        """Reshuffle for ``epoch`` and begin at its batch ``start`` (to resume); call it on every rank."""
        if not 0 <= start <= self.steps_per_epoch:
            raise ValueError(f"start must be in 0..{self.steps_per_epoch} (batches per epoch), got {start}")
        self.sampler.set_epoch(epoch)
        self.start = start
        self.sampler.skip = start * self.local_batch_size

    def __len__(self) -> int:
        """Batches left in this epoch: all of them unless :meth:`set_epoch` set a later start."""
        return self.steps_per_epoch - self.start

    def __iter__(self) -> Iterator[Batch]:
        if self.loader is None:
            for _ in range(len(self)):
                yield Batch(None, None)
            return
        for columns in self.loader:
            got = dict(zip(self.fields, columns, strict=True))
            yield Batch(got.get("inputs"), got.get("targets"))
