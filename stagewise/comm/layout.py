"""Layout: the pp x dp x fsdp x tp grid of ranks, each rank's place in it, and the layout of a world of processes."""

from __future__ import annotations

from dataclasses import dataclass, replace

from stagewise.errors import whole_number


def _check_dim(name: str, value: object) -> None:
    """Refuse a dimension that is not a whole number of ranks, at least one."""
    whole_number(name, value, least=1, fix="give 1 or more ranks (1: not split)")


DIMENSIONS = ("pp", "dp", "fsdp", "tp")
"""The mesh's dimensions, outermost first: pipeline stages, data-parallel replicas, fully-sharded data
parallelism within a replica, tensor parallelism within a layer (innermost, so its group stays within a node)."""


@dataclass(frozen=True)
class Coords:
    """Where a rank sits: its pipeline stage, its data-parallel replica, its shard of the stage's parameters
    (FSDP) and its slice of each layer (tensor parallelism)."""

    stage: int
    replica: int
    shard: int = 0
    """Its place among the ranks that shard the stage's parameters (the ``fsdp`` dimension)."""
    tp_rank: int = 0
    """Its place among the ranks that split each layer of the stage (the ``tp`` dimension)."""


@dataclass(frozen=True)
class Layout:
    """The ``pp x dp x fsdp x tp`` grid of ranks, pipeline outermost and tensor parallelism innermost:
    ``rank = ((stage * dp + replica) * fsdp + shard) * tp + tp_rank``.

    Every rank with the same ``(replica, shard, tp_rank)`` forms one pipeline (a *line*, numbered
    ``(replica * fsdp + shard) * tp + tp_rank``): activations travel along it. The ``dp x fsdp`` ranks of a
    stage with the same ``tp_rank`` each take their own share of the global batch; the ``tp`` ranks of a
    shard take the same share and split each layer.
    """

    pp: int
    """Pipeline stages (the depth of each pipeline)."""
    dp: int
    """Data-parallel replicas of each stage: each holds the stage whole (or, with ``fsdp``, sharded)."""
    fsdp: int = 1
    """Ranks each replica shards its stages' parameters, gradients and optimizer state over (FSDP)."""
    tp: int = 1
    """Ranks each layer's matmuls are split over (tensor parallelism)."""
    ep: int = 1
    """Ranks each mixture-of-experts layer's experts are split over (expert parallelism). Not a dimension of its
    own: it borrows from the ranks of a stage that take their own shares of the batch, ``ep`` consecutive ones
    (see :attr:`expert_shape`). It divides ``fsdp`` (the experts of each group of ``ep`` shards are then
    replicated over the ``fsdp / ep`` groups), or with ``fsdp = 1`` it divides ``dp``."""

    def __post_init__(self) -> None:
        for name in DIMENSIONS:
            _check_dim(name, getattr(self, name))
        _check_dim("ep", self.ep)
        borrowed = ("fsdp", self.fsdp) if self.fsdp > 1 else ("dp", self.dp)
        if borrowed[1] % self.ep:
            raise ValueError(
                f"ep={self.ep} does not divide {borrowed[0]}={borrowed[1]}: expert parallelism borrows its ranks from "
                f"fsdp (or, with fsdp=1, from dp); choose ep among {_divisors(borrowed[1])}, or give "
                f"{borrowed[0]} a multiple of {self.ep}"
            )

    @property
    def expert_shape(self) -> tuple[int, int, int, int, int]:
        """The grid of ranks as expert parallelism sees it, ``(pp, dp', fsdp', ep, tp)``: each stage's ``dp x fsdp``
        ranks cut into groups of ``ep`` consecutive ones (each holding one copy of every expert, split), and
        ``dp' x fsdp'`` copies of each expert. A reshape of the rank grid: rank numbers stay."""
        if self.fsdp > 1:
            return (self.pp, self.dp, self.fsdp // self.ep, self.ep, self.tp)
        return (self.pp, self.dp // self.ep, 1, self.ep, self.tp)

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.fsdp * self.tp

    @property
    def lines(self) -> int:
        """Pipelines: the ranks of each stage, ``dp * fsdp * tp``."""
        return self.dp * self.fsdp * self.tp

    @property
    def batch_shards(self) -> int:
        """Ranks of a stage that each take their own share of the global batch: ``dp * fsdp``."""
        return self.dp * self.fsdp

    def describe(self) -> str:
        """``pp=2 x dp=1 x fsdp=2 x tp=1``, or ``pp=2 x dp=2`` when nothing is sharded."""
        names = DIMENSIONS if self.fsdp * self.tp > 1 else DIMENSIONS[:2]
        grid = " x ".join(f"{name}={getattr(self, name)}" for name in names)
        return grid if self.ep == 1 else f"{grid} (ep={self.ep})"

    def coords(self, rank: int) -> Coords:
        """The place of global ``rank``."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside a {self.describe()} mesh of {self.world_size}")
        rest, tp_rank = divmod(rank, self.tp)
        rest, shard = divmod(rest, self.fsdp)
        stage, replica = divmod(rest, self.dp)
        return Coords(stage=stage, replica=replica, shard=shard, tp_rank=tp_rank)

    def rank(self, stage: int, replica: int, shard: int = 0, tp_rank: int = 0) -> int:
        """The global rank at ``(stage, replica, shard, tp_rank)``."""
        if not (0 <= stage < self.pp and 0 <= replica < self.dp and 0 <= shard < self.fsdp and 0 <= tp_rank < self.tp):
            where = f"(stage {stage}, replica {replica}" + (
                f", shard {shard}, tp rank {tp_rank})" if self.fsdp * self.tp > 1 else ")"
            )
            raise ValueError(f"{where} is outside a {self.describe()} mesh")
        return ((stage * self.dp + replica) * self.fsdp + shard) * self.tp + tp_rank

    def line(self, rank: int) -> int:
        """The pipeline ``rank`` belongs to, ``0 .. lines - 1`` (its replica when nothing is sharded)."""
        self.coords(rank)
        return rank % self.lines

    def at(self, stage: int, line: int) -> int:
        """The global rank running ``stage`` in pipeline ``line``."""
        if not (0 <= stage < self.pp and 0 <= line < self.lines):
            raise ValueError(f"(stage {stage}, pipeline {line}) is outside a {self.describe()} mesh")
        return stage * self.lines + line

    def batch_index(self, rank: int) -> int:
        """Which of the :attr:`batch_shards` shares of the global batch ``rank`` takes."""
        c = self.coords(rank)
        return c.replica * self.fsdp + c.shard

    def next_rank(self, rank: int) -> int | None:
        """The rank of the next stage in the same pipeline, or None on the last stage."""
        c = self.coords(rank)
        return rank + self.lines if c.stage + 1 < self.pp else None

    def prev_rank(self, rank: int) -> int | None:
        """The rank of the previous stage in the same pipeline, or None on the first stage."""
        c = self.coords(rank)
        return rank - self.lines if c.stage > 0 else None

    def pipeline_ranks(self, line: int) -> tuple[int, ...]:
        """The ranks of pipeline ``line``, stage 0 first."""
        return tuple(self.at(s, line) for s in range(self.pp))

    def replica_ranks(self, stage: int, shard: int = 0, tp_rank: int = 0) -> tuple[int, ...]:
        """The ranks holding copies of one stage's shard: its data-parallel group."""
        return tuple(self.rank(stage, r, shard, tp_rank) for r in range(self.dp))


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _fill(pp: int | None, dp: int | None, world: int, fsdp: int, tp: int) -> Layout:
    """The layout for ``world`` processes, a ``None`` one of ``pp`` and ``dp`` being the world size over the
    other dimensions (both None: one pipeline over what ``fsdp x tp`` leaves)."""
    _check_dim("fsdp", fsdp)
    _check_dim("tp", tp)
    inner = fsdp * tp
    if pp is not None and dp is not None:
        return Layout(pp, dp, fsdp, tp)
    if pp is None and dp is None:
        dp = 1
    name, other, given = ("pp", "dp", pp) if dp is None else ("dp", "pp", dp)
    assert given is not None
    _check_dim(name, given)
    if world % (given * inner):
        fits = [d for d in _divisors(world) if world % (d * inner) == 0] if world % inner == 0 else []
        sharded = f" x fsdp={fsdp} x tp={tp}" if inner > 1 else ""
        fix = f"choose {name} among {fits}" if fits else f"choose fsdp x tp among the divisors {_divisors(world)}"
        raise ValueError(
            f"{name}={given}{sharded} does not divide the world size {world}, so no {other} fits; "
            f"{fix}, or launch a multiple of {given * inner} processes"
        )
    rest = world // (given * inner)
    return Layout(given, rest, fsdp, tp) if name == "pp" else Layout(rest, given, fsdp, tp)


def layout_for(pp: int | None, dp: int | None, world: int, fsdp: int = 1, tp: int = 1, ep: int = 1) -> Layout:
    """The layout of ``world`` processes, a ``None`` one of ``pp`` and ``dp`` being the world size over the other
    dimensions (see :func:`_fill`), with ``ep`` expert-parallel ranks borrowed from them; refused, saying what would
    fit, unless it covers them all."""
    layout = _fill(pp, dp, world, fsdp, tp)
    if layout.world_size != world:
        names = "pp and dp" if layout.fsdp * layout.tp == 1 else "pp, dp, fsdp and tp"
        raise ValueError(
            f"{layout.describe()} = {layout.world_size} processes, but the world size is {world}; "
            f"choose {names} whose product is {world}, or launch {layout.world_size} processes"
        )
    return layout if ep == 1 else replace(layout, ep=ep)
