"""Actions and schedules as plain data, with a compact text form ("0F3": stage 0, forward, micro-batch 3)."""

from __future__ import annotations

import enum
import functools
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path


class Kind(enum.Enum):
    """What an action computes."""

    F = "F"
    """Forward."""
    B = "B"
    """Full backward: input and weight gradients together."""
    I = "I"  # noqa: E741  # the letter zero-bubble papers use
    """Input-gradient-only backward (zero-bubble); its weight gradient comes later as W."""
    W = "W"
    """Weight-gradient of an earlier I."""

    @property
    def is_backward(self) -> bool:
        """True for B and I: the actions that pass a gradient to the previous stage."""
        return self in (Kind.B, Kind.I)


_TOKEN = re.compile(r"^(\d+)([FBIW])(\d+)$")


@dataclass(frozen=True)
class Action:
    """One unit of work: ``kind`` for ``microbatch`` on ``stage``. Prints as ``"0F3"``."""

    stage: int
    kind: Kind
    microbatch: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind.value}{self.microbatch}"

    @classmethod
    def parse(cls, token: str) -> Action:
        """Read an action from its text form, e.g. ``"2B7"``."""
        match = _TOKEN.match(token.strip())
        if match is None:
            raise ValueError(
                f"cannot read action {token!r}; write stage, kind, micro-batch, e.g. 0F3 "
                "(kinds: F forward, B backward, I input-gradient, W weight-gradient)"
            )
        return cls(int(match.group(1)), Kind(match.group(2)), int(match.group(3)))


@dataclass(frozen=True)
class Schedule:
    """For each rank, the ordered actions it runs in one training step, and which rank holds each stage.

    By default stage ``s`` lives on rank ``s % n_ranks``: with more stages than
    ranks (interleaved, virtual stages) rank ``r`` holds stages ``r, r + p, r + 2p, ...``.
    A :attr:`placement` says otherwise, e.g. the V of ZBV and DualPipeV, where
    rank ``r`` holds stages ``r`` and ``2p - 1 - r``.
    """

    name: str
    """Where the schedule came from: a builder's name, or "custom"."""
    n_stages: int
    """Number of stages, a multiple of the number of ranks."""
    n_microbatches: int
    """Micro-batches per step."""
    ranks: tuple[tuple[Action, ...], ...]
    """``ranks[r]`` is rank ``r``'s actions, in the order it runs them."""
    placement: tuple[int, ...] = ()
    """``placement[s]`` is the rank that holds stage ``s``, each rank ``n_stages / n_ranks`` of them; empty (the
    default): ``s % n_ranks``, round robin."""

    def __post_init__(self) -> None:
        p = len(self.ranks)
        if p < 1:
            raise ValueError("a schedule needs at least one rank")
        if self.n_stages < 1 or self.n_stages % p:
            raise ValueError(
                f"{self.n_stages} stages cannot be spread over {p} ranks; the stage count must be a positive "
                "multiple of the rank count (each rank holds as many stages as the others)"
            )
        if self.n_microbatches < 1:
            raise ValueError(f"n_microbatches must be >= 1, got {self.n_microbatches}")
        given = tuple(self.placement)  # a list given by hand is kept as a tuple, like the rest of the schedule
        object.__setattr__(self, "placement", given or tuple(s % p for s in range(self.n_stages)))
        _check_placement(self.placement, self.n_stages, p)
        for rank, actions in enumerate(self.ranks):
            for i, action in enumerate(actions):
                if not 0 <= action.stage < self.n_stages or not 0 <= action.microbatch < self.n_microbatches:
                    raise ValueError(
                        f"rank {rank}, action {i} ({action}) is outside {self.n_stages} stages x "
                        f"{self.n_microbatches} micro-batches"
                    )
                if self.placement[action.stage] != rank:
                    raise ValueError(
                        f"rank {rank}, action {i} ({action}) belongs to rank {self.placement[action.stage]}, which "
                        f"holds stage {action.stage} (placement {list(self.placement)}); move it to that rank's line"
                    )

    @property
    def n_ranks(self) -> int:
        return len(self.ranks)

    @property
    def n_virtual(self) -> int:
        """Stages per rank."""
        return self.n_stages // self.n_ranks

    @property
    def round_robin(self) -> bool:
        """True when stage ``s`` lives on rank ``s % n_ranks`` (every built-in placement but the V)."""
        return self.placement == tuple(s % self.n_ranks for s in range(self.n_stages))

    def rank_of(self, stage: int) -> int:
        """The rank that runs ``stage``."""
        return self.placement[stage]

    def stages_of(self, rank: int) -> tuple[int, ...]:
        """The stages that ``rank`` holds, in increasing order."""
        return self._held[rank]

    @functools.cached_property
    def _held(self) -> tuple[tuple[int, ...], ...]:
        """Each rank's stages, read off :attr:`placement` once (the planner asks for them per layout and rank)."""
        return tuple(tuple(s for s, r in enumerate(self.placement) if r == rank) for rank in range(self.n_ranks))

    @property
    def splits_backward(self) -> bool:
        """True when backward runs as I then W (zero-bubble style)."""
        return any(a.kind is Kind.I for actions in self.ranks for a in actions)

    def to_text(self) -> str:
        """One line per rank, ``rank 0: 0F0 0F1 0B0 ...``, after a comment naming the schedule."""
        lines = [f"# {self.name}: {self.n_stages} stages, {self.n_microbatches} micro-batches, {self.n_ranks} ranks"]
        lines += [f"rank {r}: " + " ".join(str(a) for a in actions) for r, actions in enumerate(self.ranks)]
        return "\n".join(lines) + "\n"

    @classmethod
    def from_text(cls, text: str, *, name: str = "custom") -> Schedule:
        """Read a schedule written by :meth:`to_text` (or by hand in the same form).

        Lines starting with ``#`` are comments. Each other line is
        ``rank N: action action ...``, ranks numbered from 0 in order. Stage
        and micro-batch counts are the largest ones used, plus one; each stage
        is held by the rank whose line runs it (a V is read as a V).
        """
        ranks: list[tuple[Action, ...]] = []
        for number, raw in enumerate(text.splitlines(), start=1):
            line = raw.split("#", 1)[0].strip()
            if not line:
                continue
            head, sep, body = line.partition(":")
            match = re.fullmatch(r"rank\s+(\d+)", head.strip())
            if not sep or match is None:
                raise ValueError(f"line {number}: expected 'rank N: 0F0 0B0 ...', got {raw!r}")
            if int(match.group(1)) != len(ranks):
                raise ValueError(f"line {number}: expected rank {len(ranks)} next, got rank {match.group(1)}")
            try:
                ranks.append(tuple(Action.parse(tok) for tok in body.split()))
            except ValueError as err:
                raise ValueError(f"line {number}: {err}") from err
        actions = [a for r in ranks for a in r]
        if not actions:
            raise ValueError("the schedule text has no actions; write lines like 'rank 0: 0F0 0B0'")
        n_stages = max(a.stage for a in actions) + 1
        p = len(ranks)
        n_stages = -(-n_stages // p) * p  # round up to a multiple of the rank count
        holder = {a.stage: r for r in reversed(range(p)) for a in ranks[r]}  # the first rank that runs each stage
        placement = tuple(holder.get(s, s % p) for s in range(n_stages))
        if sorted(placement) != sorted(s % p for s in range(n_stages)):  # not a placement: keep the default's error
            placement = ()
        return cls(name, n_stages, max(a.microbatch for a in actions) + 1, tuple(ranks), placement)

    @classmethod
    def load(cls, path: str | Path) -> Schedule:
        """Read a schedule text file (see :meth:`from_text`)."""
        file = Path(path)
        return cls.from_text(file.read_text(), name=file.stem)


def _check_placement(placement: tuple[int, ...], n_stages: int, n_ranks: int) -> None:
    """Refuse a placement that is not one rank per stage with every rank holding ``n_stages / n_ranks``."""
    if len(placement) != n_stages or any(not 0 <= r < n_ranks for r in placement):
        raise ValueError(
            f"placement {list(placement)} must give each of the {n_stages} stages a rank in 0 .. {n_ranks - 1}"
        )
    counts = [placement.count(r) for r in range(n_ranks)]
    if len(set(counts)) > 1:
        raise ValueError(
            f"placement {list(placement)} gives the ranks {counts} stages; each must hold {n_stages // n_ranks} "
            f"({n_stages} stages on {n_ranks} ranks)"
        )


def forwards_first(actions: Sequence[Action]) -> bool:
    """True when each stage's forwards all come before its first backward (GPipe), as in ``actions``."""
    first_backward: dict[int, int] = {}
    for i, action in enumerate(actions):
        if action.kind.is_backward:
            first_backward.setdefault(action.stage, i)
        elif action.kind is Kind.F and action.stage in first_backward:
            return False
    return True
