"""balance(): the exact contiguous split that minimises the slowest stage, under memory capacities."""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from stagewise.errors import StagewiseError, is_whole
from stagewise.partition.memory import MemoryModel
from stagewise.partition.range_cost import FloatArray, RangeCost
from stagewise.partition.shared_cost import Tie, check_ties
from stagewise.partition.solver import SplitProblem, solve
from stagewise.partition.split import Partition
from stagewise.schedule.holdings import Holding
from stagewise.units import format_bytes

log = logging.getLogger(__name__)

Weights = Sequence[float] | FloatArray


class CapacityError(StagewiseError, ValueError):
    """No split fits the devices' memory; names the layer or stage that overflows."""

    def __init__(self, message: str, *, stage: int | None, layer: int | None, overflow: float) -> None:
        super().__init__(message)
        self.stage = stage
        """The stage that overflows at the best split, or None when a single layer fits no stage."""
        self.layer = layer
        """The layer that fits no stage on its own, or None."""
        self.overflow = overflow
        """Bytes beyond the capacity at the best split (or of the layer on the roomiest stage)."""


def _vector(field: str, values: Weights, *, length: int | None, positive: bool = False) -> FloatArray:
    """``values`` as a float64 vector, refused with the first bad entry when not finite and >= 0."""
    if isinstance(values, (str, bytes)) or not hasattr(values, "__len__"):
        raise TypeError(f"{field} must be a sequence of numbers, got {type(values).__name__}")
    try:
        array = np.asarray(values, dtype=np.float64)
    except (TypeError, ValueError) as err:
        raise TypeError(f"{field} must be a sequence of numbers: {err}") from err
    if array.ndim != 1:
        raise ValueError(f"{field} must be one-dimensional, got shape {array.shape}")
    if length is not None and len(array) != length:
        raise ValueError(f"{field} has {len(array)} entries but there are {length}; give exactly {length}")
    bad = ~np.isfinite(array) | ((array <= 0) if positive else (array < 0))
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        need = "positive and finite" if positive else "finite and >= 0"
        raise ValueError(
            f"{field}[{i}] is {float(array[i])!r}; every entry must be {need} "
            f"({int(bad.sum())} of {len(array)} are not)"
        )
    return array


def _layer_label(i: int, names: Sequence[str] | None) -> str:
    return f"layer {i} ({names[i]!r})" if names is not None else f"layer {i}"


def _stage_label(stage: int, lo: int, hi: int, names: Sequence[str] | None) -> str:
    span = f"{names[lo]} .. {names[hi - 1]}" if names is not None else f"{lo} .. {hi - 1}"
    return f"stage {stage} (layers {lo}:{hi}, {span})"


def _extremes(moments: Sequence[Holding]) -> list[tuple[int, int]]:
    """The moments that can be the fullest for some bytes per micro-batch in flight and pooled (both >= 0).

    ``a * in_flight + p * pooled`` is largest at a vertex of the upper-right
    hull of the moments, so the others (dominated, or on a segment between
    two, as GPipe's ``(m - j, j)``) never decide a stage's bytes.
    """
    points = sorted({(h.in_flight, h.pooled) for h in moments}, key=lambda q: (-q[0], -q[1]))
    front: list[tuple[int, int]] = []
    for a, b in points:  # by in-flight count, most first: keep those with more pooled than any before
        if not front or b > front[-1][1]:
            front.append((a, b))
    hull: list[tuple[int, int]] = []
    for p in reversed(front):  # fewest in flight (most pooled) first
        while len(hull) >= 2:
            (oa, ob), (ma, mb) = hull[-2], hull[-1]
            if (ma - oa) * (p[1] - ob) - (mb - ob) * (p[0] - oa) < 0:
                break
            hull.pop()  # on or inside the segment from hull[-2] to p
        hull.append(p)
    return hull


def _memory_cost(model: MemoryModel) -> RangeCost:
    """The model as a range cost: activations and pooled bytes, counted by each stage's fullest moment."""
    moments = [_extremes(model.moments(s)) for s in range(model.n_stages)]
    pooling = bool(model.pooled) and any(b for stage in moments for _, b in stage)
    activation = np.asarray(model.activation, dtype=np.float64)
    heads: list[FloatArray | None] = []
    if model.shared:  # what two neighbours save once: counted in the first layer of a stage only
        shared = np.asarray(model.shared, dtype=np.float64)
        shared[0] = 0.0  # nothing comes before the first layer
        activation, heads = activation - shared, [shared]
    y = [activation]
    if pooling:
        y.append(np.asarray(model.pooled, dtype=np.float64))
        heads += [None] if heads else []
    forms = [[(a, b) if pooling else (a,) for a, b in stage] for stage in moments]
    fixed = np.asarray(model.fixed, dtype=np.float64)
    return RangeCost.of_layers(fixed, model.n_stages, y=y, forms=forms, heads=heads, ties=model.ties)


@dataclass(frozen=True)
class _Shown:
    """A need and a capacity as a message shows them."""

    need: str
    capacity: str
    over: str
    note: str


def _sizes(need: float, capacity: float) -> _Shown:
    """In bytes with units; as exact numbers where they differ by less than a byte or the units would show them
    equal (fractions that round)."""
    if need - capacity >= 1 and format_bytes(need) != format_bytes(capacity):
        return _Shown(format_bytes(need), format_bytes(capacity), format_bytes(need - capacity), "")
    return _Shown(
        repr(need),
        repr(capacity),
        repr(need - capacity),
        " (float64 sums round: give sizes in whole bytes, or a capacity a little larger)",
    )


def _explain_overflow(model: MemoryModel, caps: FloatArray, names: Sequence[str] | None) -> CapacityError:
    """Why no split fits: a layer too big for every stage, or the stage that overflows at the best split."""
    k = model.n_stages
    mem = _memory_cost(model)
    per_stage = np.stack([mem.singles(j) for j in range(k)])  # [stage, layer]
    fits_somewhere = (per_stage <= caps[:, None]).any(axis=0)
    if not fits_somewhere.all():
        i = int(np.flatnonzero(~fits_somewhere)[0])
        best = int(np.argmin(per_stage[:, i] - caps))
        need, cap = float(per_stage[best, i]), float(caps[best])
        shown = _sizes(need, cap)
        return CapacityError(
            f"{_layer_label(i, names)} alone needs {shown.need} on stage {best}, where it comes closest "
            f"to fitting (capacity {shown.capacity}), and more than the capacity on every other stage{shown.note}; "
            f"no stage can hold it. Give stage {best}'s device more memory, shrink the layer, or lower its "
            "activation memory (fewer micro-batches in flight, smaller micro-batches).",
            stage=None,
            layer=i,
            overflow=need - cap,
        )
    # The split that uses the smallest worst fraction of each device's memory.
    fraction = dataclasses.replace(mem, divisor=caps)
    best_fit = solve(SplitProblem(k, fraction))
    assert best_fit is not None
    b = best_fit.bounds
    over = [mem.of(j, b[j], b[j + 1]) - float(caps[j]) for j in range(k)]
    s = int(np.argmax([mem.of(j, b[j], b[j + 1]) / float(caps[j]) for j in range(k)]))
    need = mem.of(s, b[s], b[s + 1])
    shown = _sizes(need, float(caps[s]))
    return CapacityError(
        f"no split of {model.n_layers} layers into {k} stages fits the capacities: at the split that "
        f"uses the least of each device's memory (bounds {list(b)}), {_stage_label(s, b[s], b[s + 1], names)} "
        f"needs {shown.need} > capacity {shown.capacity}, over by {shown.over}{shown.note}. "
        "Use more stages, devices with more memory, "
        "or fewer micro-batches in flight.",
        stage=s,
        layer=None,
        overflow=over[s],
    )


def balance(
    weights: Weights | MemoryModel,
    n_stages: int,
    *,
    speeds: Weights | None = None,
    memory: Weights | MemoryModel | None = None,
    capacities: Weights | None = None,
    names: Sequence[str] | None = None,
    ties: Sequence[Tie] = (),
) -> Partition:
    """The contiguous split into ``n_stages`` non-empty stages that minimises the slowest stage.

    Stage ``s`` costs ``sum(weights of its layers) / speeds[s]``, each of
    ``ties`` counted once; the result minimises the maximum of that over
    stages, exactly (property-tested against brute force), subject to
    ``memory of stage s <= capacities[s]``.

    Args:
        weights: per-layer cost (time, FLOPs, parameters, ...), finite and >= 0;
            or a :class:`MemoryModel` to balance memory itself.
        n_stages: number of stages, 1 <= n_stages <= number of layers.
        speeds: per-stage relative device speed (> 0); all 1 when omitted.
        memory: per-layer bytes, or a :class:`MemoryModel` whose activation
            bytes scale with each stage's micro-batches in flight.
        capacities: per-stage bytes available; requires ``memory``.
        names: per-layer names, used in the report and in error messages.
        ties: amounts of ``weights`` that several layers include and a stage
            counts once (tied parameters, when balancing parameters); a
            :class:`MemoryModel` carries its own.

    Stage costs are differences of float64 prefix sums, and the split is
    exact for those: when the weights span more than about 1e15 (the sum over
    the smallest positive weight), small layers are lost to rounding, and
    ``balance`` logs a warning saying how many.

    Ties between optimal splits are broken the same way every time: going
    backwards from the last stage, each stage starts as early as the optimum
    allows, so later stages take as many layers as they can and the first
    stages, which hold the most micro-batches in flight under 1F1B, the fewest.

    Raises:
        ValueError: bad counts, lengths or values (the message names them).
        CapacityError: no split fits the capacities; names the layer or stage.
    """
    n_stages = _stage_count(n_stages)
    w, total, weight_model = _layer_weights(weights)
    n = len(w)
    if n_stages > n:
        raise ValueError(f"cannot split {n} layers into {n_stages} non-empty stages; use n_stages <= {n}")
    if names is not None and len(names) != n:
        raise ValueError(f"names has {len(names)} entries but there are {n} layers; give one name per layer")
    s = np.ones(n_stages) if speeds is None else _vector("speeds", speeds, length=n_stages, positive=True)
    _check_range(w, total, s)
    load_cost = _load_cost(w, weight_model, ties, n_stages)
    # Same sums, divided by each stage's speed: a stage's time is bit-for-bit load / speed.
    objective = dataclasses.replace(load_cost, divisor=s)
    model = _memory_model(memory, n, n_stages)
    caps = _capacities(capacities, model, n_stages)
    constraint = _memory_cost(model) if model is not None else None
    for field, cost in (("weights", load_cost), ("memory", constraint)):
        _check_finite(field, cost, n)

    solution = solve(SplitProblem(n_stages, objective, constraint if caps is not None else None, caps))
    if solution is None:
        assert model is not None and caps is not None
        raise _explain_overflow(model, caps, names)
    b = solution.bounds
    part = _partition(b, load_cost, s, constraint, caps, names)
    log.debug("balanced %d layers into %d stages: bounds %s, bottleneck %.6g", n, n_stages, b, part.bottleneck)
    return part


def _partition(
    b: tuple[int, ...],
    load_cost: RangeCost,
    speeds: FloatArray,
    constraint: RangeCost | None,
    caps: FloatArray | None,
    names: Sequence[str] | None,
) -> Partition:
    """The split at bounds ``b``, with each stage's load and memory by the same formulas the solver compared."""
    n_stages = len(b) - 1
    return Partition(
        bounds=b,
        loads=tuple(load_cost.of(j, b[j], b[j + 1]) for j in range(n_stages)),
        speeds=tuple(float(x) for x in speeds),
        memory=None if constraint is None else tuple(constraint.of(j, b[j], b[j + 1]) for j in range(n_stages)),
        capacities=None if caps is None else tuple(float(c) for c in caps),
        names=None if names is None else tuple(names),
    )


def _stage_count(n_stages: object) -> int:
    """``n_stages`` as an int, refused unless it is an integer >= 1."""
    if not is_whole(n_stages):
        raise TypeError(f"n_stages must be an int, got {type(n_stages).__name__}")
    count = int(n_stages)
    if count < 1:
        raise ValueError(f"n_stages must be >= 1, got {count}")
    return count


def _layer_weights(weights: Weights | MemoryModel) -> tuple[FloatArray, float, MemoryModel | None]:
    """Each layer's weight (a :class:`MemoryModel`'s fixed bytes), their sum, and the model when ``weights`` is
    one; refused when empty or when they sum past float64."""
    weight_model = weights if isinstance(weights, MemoryModel) else None
    w = (
        np.asarray(weight_model.fixed, dtype=np.float64)
        if weight_model is not None
        else _vector("weights", weights, length=None)  # type: ignore[arg-type]
    )
    if len(w) == 0:
        raise ValueError("there are no layers to split (weights is empty); give one weight per layer")
    with np.errstate(over="ignore"):
        total = float(w.sum())
    if not math.isfinite(total):
        raise ValueError(f"weights sum to {total!r}, which overflows float64; scale them down")
    return w, total, weight_model


def _load_cost(w: FloatArray, weight_model: MemoryModel | None, ties: Sequence[Tie], n_stages: int) -> RangeCost:
    """What a stage's layers weigh: ``w`` summed, each tie once; or the memory ``weight_model`` holds."""
    if weight_model is None:
        return RangeCost.of_layers(w, n_stages, ties=check_ties("ties", ties, w.tolist()))
    if ties:
        raise ValueError("ties were given beside a MemoryModel as weights; put them in the model's ties instead")
    _check_model("weights", weight_model, len(w), n_stages)
    return _memory_cost(weight_model)


def _memory_model(memory: Weights | MemoryModel | None, n_layers: int, n_stages: int) -> MemoryModel | None:
    """``memory`` as a checked :class:`MemoryModel`: per-layer bytes become one that holds them once."""
    if memory is None:
        return None
    if isinstance(memory, MemoryModel):
        _check_model("memory", memory, n_layers, n_stages)
        return memory
    fixed = _vector("memory", memory, length=n_layers)
    return MemoryModel(tuple(fixed.tolist()), (0.0,) * n_layers, (1,) * n_stages)


def _capacities(capacities: Weights | None, model: MemoryModel | None, n_stages: int) -> FloatArray | None:
    """The per-stage capacities, positive; refused without a memory model to hold them against."""
    if capacities is None:
        return None
    if model is None:
        raise ValueError("capacities were given without memory; pass memory= (per-layer bytes or a MemoryModel)")
    return _vector("capacities", capacities, length=n_stages, positive=True)


def _check_finite(field: str, cost: RangeCost | None, n_layers: int) -> None:
    """Refuse a cost whose whole model overflows float64 on some stage: its sums would be inf or NaN."""
    if cost is None:
        return
    for stage in range(len(cost.divisor)):
        whole = cost.of(stage, 0, n_layers)
        if not math.isfinite(whole):
            raise ValueError(
                f"{field}: all layers together on stage {stage} come to {whole!r}, which overflows float64; "
                "give the sizes in larger units (only their ratios to the capacities matter)"
            )


def _check_range(w: FloatArray, total: float, speeds: FloatArray) -> None:
    """Refuse times that leave float64's normal range; warn when prefix sums lose small layers to rounding."""
    slowest, fastest = float(speeds.min()), float(speeds.max())
    positive = w[w > 0]
    smallest = float(positive.min()) if len(positive) else math.inf
    with np.errstate(over="ignore", under="ignore"):
        longest, shortest = total / slowest, smallest / fastest
    if not math.isfinite(longest):
        raise ValueError(
            f"the weights' sum {total!r} over the slowest speed {slowest!r} overflows float64; "
            "scale the weights down or the speeds up (only their ratios matter)"
        )
    if shortest == 0:
        raise ValueError(
            f"the smallest positive weight {smallest!r} over the fastest speed {fastest!r} underflows "
            "float64 to 0; scale the weights up or the speeds down (only their ratios matter)"
        )
    if total / smallest > _SPAN:
        prefix = np.cumsum(w, dtype=np.float64)
        recovered = np.diff(prefix, prepend=0.0)
        lost = int((np.abs(recovered - w) > 1e-6 * w).sum())
        if lost:
            log.warning(
                "the weights span %.3g x (sum %.6g, smallest positive %.6g): float64 prefix sums change %d of %d "
                "layers' weights by more than 1e-6 of themselves, so the split is exact only for the rounded sums; "
                "merge the smallest layers or drop them",
                total / smallest,
                total,
                smallest,
                lost,
                len(w),
            )


_SPAN = 2.0**30
"""Above this ratio of the weights' sum to the smallest positive weight, check what rounding does to the sums."""


def _check_model(field: str, model: MemoryModel, n_layers: int, n_stages: int) -> None:
    if model.n_layers != n_layers:
        raise ValueError(f"{field} describes {model.n_layers} layers but there are {n_layers}")
    if model.n_stages != n_stages:
        raise ValueError(
            f"{field} has in-flight counts for {model.n_stages} stages but n_stages is {n_stages}; "
            "build it with the same stage count"
        )
    fields = (("fixed", model.fixed), ("activation", model.activation), ("pooled", model.pooled))
    for name, values in (*fields, ("shared", model.shared)):
        if values or name not in ("pooled", "shared"):
            _vector(f"{field}.{name}", values, length=n_layers)
    if not all(math.isfinite(q) for q in model.in_flight):
        raise ValueError(f"{field}.in_flight must be finite, got {list(model.in_flight)}")
