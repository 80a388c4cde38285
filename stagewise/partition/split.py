"""Partition: which contiguous layers each pipeline stage owns, with its loads and memory."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from torch import nn

if TYPE_CHECKING:  # importing torch.distributed.pipelining takes a second and a half (dynamo, DTensor)
    from torch.distributed.pipelining import SplitPoint

from stagewise.units import format_bytes


@dataclass(frozen=True)
class Partition:
    """A split of ``n_layers`` ordered layers into ``n_stages`` non-empty contiguous stages.

    Stage ``s`` owns layers ``bounds[s]:bounds[s + 1]``. Build one with
    :func:`stagewise.partition.balance`, or directly from known bounds.
    """

    bounds: tuple[int, ...]
    """Stage boundaries: ``bounds[0] == 0``, strictly increasing, ``bounds[-1] == n_layers``."""
    loads: tuple[float, ...]
    """Per stage: the summed weight of its layers (time, FLOPs, parameters or bytes), a tie among them counted once."""
    speeds: tuple[float, ...]
    """Per stage: the relative speed of its device; a stage's time is ``load / speed``."""
    memory: tuple[float, ...] | None = None
    """Per stage: bytes the stage needs, when a memory model was given."""
    capacities: tuple[float, ...] | None = None
    """Per stage: bytes its device offers, when capacities were given."""
    names: tuple[str, ...] | None = None
    """Per layer: its name in the unsplit model, when known."""
    params: tuple[int, ...] | None = None
    """Per stage: parameter count, when known."""

    def __post_init__(self) -> None:
        b = self.bounds
        k = len(b) - 1
        if k < 1 or b[0] != 0 or any(b[i] >= b[i + 1] for i in range(k)):
            raise ValueError(f"bounds must start at 0 and strictly increase (no empty stage), got {list(b)}")
        for field, values in (
            ("loads", self.loads),
            ("speeds", self.speeds),
            ("memory", self.memory),
            ("capacities", self.capacities),
            ("params", self.params),
        ):
            if values is not None and len(values) != k:
                raise ValueError(f"{field} has {len(values)} entries for {k} stages; give one per stage")
        if self.names is not None and len(self.names) != b[-1]:
            raise ValueError(f"names has {len(self.names)} entries for {b[-1]} layers; give one per layer")

    @property
    def n_stages(self) -> int:
        return len(self.bounds) - 1

    @property
    def n_layers(self) -> int:
        return self.bounds[-1]

    @property
    def times(self) -> tuple[float, ...]:
        """Per stage: ``load / speed``, the quantity whose maximum is minimised."""
        return tuple(load / speed for load, speed in zip(self.loads, self.speeds, strict=True))

    @property
    def bottleneck(self) -> float:
        """The slowest stage's ``load / speed``."""
        return max(self.times)

    @property
    def imbalance(self) -> float:
        """Bottleneck over the mean stage time: 1.0 is perfect balance."""
        mean = sum(self.times) / self.n_stages
        return self.bottleneck / mean if mean > 0 else 1.0

    def layers(self, stage: int) -> range:
        """The layer indices of ``stage``."""
        if not 0 <= stage < self.n_stages:
            raise IndexError(f"stage {stage} out of range; this partition has {self.n_stages} stages")
        return range(self.bounds[stage], self.bounds[stage + 1])

    def split_spec(self, model: nn.Module) -> dict[str, SplitPoint]:
        """The split points of this partition for ``torch.distributed.pipelining.pipeline()``.

        Each stage after the first begins at its first layer, named by its path
        in ``model`` (a chain; see :func:`stagewise.partition.layers_of`), so
        torch's tracer cuts the model where this partition does:
        ``pipeline(model, mb_args=(x,), split_spec=part.split_spec(model))``.
        """
        from stagewise.partition.layers import layers_of

        layers = layers_of(model)
        if len(layers) != self.n_layers:
            raise ValueError(
                f"this partition splits {self.n_layers} layers but the model has {len(layers)}; "
                "partition this model's layers"
            )
        from torch.distributed.pipelining import SplitPoint

        return {layers[b].name: SplitPoint.BEGINNING for b in self.bounds[1:-1]}

    def stage_of(self, layer: int) -> int:
        """The stage that owns ``layer``."""
        if not 0 <= layer < self.n_layers:
            raise IndexError(f"layer {layer} out of range; this partition has {self.n_layers} layers")
        lo, hi = 0, self.n_stages - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.bounds[mid] <= layer:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def report(self) -> str:
        """A table: stage, layer range, first and last layer names, params, load share, memory."""
        total = sum(self.loads) or 1.0
        header = ["stage", "layers", "first .. last", "params", "load", "share", "time"]
        if self.memory is not None:
            header.append("memory")
        if self.capacities is not None:
            header.append("capacity")
        rows = [header]
        for s in range(self.n_stages):
            lo, hi = self.bounds[s], self.bounds[s + 1]
            span = f"{self.names[lo]} .. {self.names[hi - 1]}" if self.names else f"{lo} .. {hi - 1}"
            row = [
                str(s),
                f"{lo}:{hi}",
                span,
                f"{self.params[s]:,}" if self.params is not None else "-",
                f"{self.loads[s]:.4g}",
                f"{100 * self.loads[s] / total:.1f}%",
                f"{self.times[s]:.4g}",
            ]
            if self.memory is not None:
                row.append(format_bytes(self.memory[s]))
            if self.capacities is not None:
                row.append(format_bytes(self.capacities[s]))
            rows.append(row)
        widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
        lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip() for r in rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        lines.append(
            f"bottleneck {self.bottleneck:.6g}, imbalance {self.imbalance:.3f} "
            f"(bottleneck / mean stage time; 1.000 is perfect)"
        )
        return "\n".join(lines)

    def to_json(self) -> str:
        """This partition as a JSON object; :meth:`from_json` reads it back."""
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Partition:
        """Read a partition written by :meth:`to_json`."""
        try:
            data: dict[str, Any] = json.loads(text)
        except json.JSONDecodeError as err:
            raise ValueError(f"not a JSON partition: {err}") from err
        if not isinstance(data, dict) or "bounds" not in data:
            raise ValueError("a JSON partition is an object with at least 'bounds' (and loads, speeds, ... optional)")
        known = {f for f in cls.__dataclass_fields__}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown fields in JSON partition: {unknown}; expected a subset of {sorted(known)}")
        bounds = _json_numbers(data, "bounds", whole=True) or ()  # Partition refuses empty bounds, saying why
        k = len(bounds) - 1
        names = data.get("names")
        if names is not None and not (isinstance(names, list) and all(isinstance(n, str) for n in names)):
            raise ValueError(f"names in a JSON partition must be a list of strings, got {names!r}")
        return cls(
            bounds=tuple(int(b) for b in bounds),
            loads=_json_numbers(data, "loads") or (0.0,) * k,
            speeds=_json_numbers(data, "speeds", positive=True) or (1.0,) * k,
            memory=_json_numbers(data, "memory"),
            capacities=_json_numbers(data, "capacities", positive=True),
            names=None if names is None else tuple(names),
            params=None
            if data.get("params") is None
            else tuple(int(p) for p in _json_numbers(data, "params", whole=True) or ()),
        )

    @classmethod
    def from_bounds(cls, bounds: Sequence[int], weights: Sequence[float] | None = None) -> Partition:
        """A partition with the given bounds; loads are summed from ``weights`` (or layer counts)."""
        b = tuple(int(x) for x in bounds)
        w = [1.0] * (b[-1] if b else 0) if weights is None else [float(x) for x in weights]
        if b and len(w) != b[-1]:
            raise ValueError(f"bounds end at layer {b[-1]} but {len(w)} weights were given")
        loads = tuple(sum(w[b[s] : b[s + 1]]) for s in range(len(b) - 1))
        return cls(bounds=b, loads=loads, speeds=(1.0,) * len(loads))


def _json_numbers(
    data: dict[str, Any], key: str, *, positive: bool = False, whole: bool = False
) -> tuple[float, ...] | None:
    """``data[key]`` as finite numbers (> 0 with ``positive``, >= 0 otherwise; integers with ``whole``), or None."""
    values = data.get(key)
    if values is None:
        return None
    if not isinstance(values, list) or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
        raise ValueError(f"{key} in a JSON partition must be a list of numbers, got {values!r}")
    bad = [
        v for v in values if not math.isfinite(v) or (v <= 0 if positive else v < 0) or (whole and float(v) != int(v))
    ]
    if bad:
        kind = "whole numbers" if whole else "numbers"
        sign = "> 0" if positive else ">= 0"
        raise ValueError(f"{key} in a JSON partition must be finite {kind} {sign}, got {values!r}")
    return tuple(float(v) for v in values)
