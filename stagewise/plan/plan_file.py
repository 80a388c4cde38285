"""The plan file: what ``stagewise plan --json`` writes and ``stagewise train --plan`` reads, field by field.

It holds the settings a plan chooses in the sections and under the names of a job file
(:mod:`stagewise.run.job`): ``{"model": {"model": ..., "seq_len": ...}, "layout": {"pp": ..., "dp": ...,
"partition": [...]}, "schedule": {...}, "compute": {...}, "optimizer": {...}}``, and the planner's
predictions under ``"predicted"``.

A plan file is data from somewhere else, so each field is checked for its type and range before anything is built
from it, and a refusal is one line naming the field, its value and the fix. It names no code: its model is a
preset or ``hf:DIR``, never ``MODULE:FACTORY``, which would be imported and run in the launcher and on every rank;
a factory comes from the command line (``--model``), which a plan naming the same one then agrees with.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, get_args

from stagewise.errors import is_whole
from stagewise.models import PRESETS
from stagewise.plan.measure import OptimizerKind
from stagewise.schedule import Schedule, ScheduleName
from stagewise.schedule.actions import Action

HF = "hf:"
"""The prefix of a model given as a local Hugging Face folder (:data:`stagewise.run.user_model.HF`, which this
layer, below ``run``, does not import)."""

MAX_PLAN_BYTES = 8 * 2**20
"""The largest plan file read: plans are a few hundred bytes, or some KiB with a synthesised schedule."""
MAX_SCHEDULE_CHARS = 4 * 2**20
"""The longest ``schedule_text`` whatever the layout; a layout's own bound is usually far lower (see
:func:`schedule_text_bound`)."""
ACTIONS_PER_MICROBATCH = 3
"""Actions a stage runs per micro-batch at most: a forward, then a backward (B) or its two halves (I and W)."""
CHARS_PER_ACTION = 32
"""Characters a schedule text may spend per action it can hold (an action is ``"12F345 "``; the rest is the
``rank N:`` heads and comments)."""
COMMENT_CHARS = 4096
"""Characters of a schedule text beyond its actions' share: the comment line :meth:`Schedule.to_text` writes."""
_JSON_TYPES = {str: "string", list: "array", int: "number", float: "number", bool: "boolean", type(None): "null"}
_REWRITE = "write the plan again with `stagewise plan --json PLAN`"


@dataclass(frozen=True)
class PlanField:
    """One field of a plan file: its name, what it must be (as a refusal says it), and whether it may be left out
    or be null."""

    name: str
    section: str
    """The section of the job file (and of the plan file) that holds it; ``predicted`` is a section of its own."""
    expects: str
    """What a value must be, completing "... is not <expects>"."""
    accepts: Callable[[Any], bool]
    required: bool = True
    nullable: bool = False
    fix: str = ""
    """How to mend a refused value, when it is more than writing the plan again."""


def _count(value: Any) -> bool:
    return is_whole(value) and value >= 1


def _one_of(choices: tuple[str, ...]) -> Callable[[Any], bool]:
    return lambda value: isinstance(value, str) and value in choices


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _bounds(value: Any) -> bool:
    """Stage bounds: whole numbers from 0, strictly increasing."""
    if not isinstance(value, list) or len(value) < 2 or not all(is_whole(b) for b in value):
        return False
    return value[0] == 0 and all(b > a for a, b in itertools.pairwise(value))


def _model(value: Any) -> bool:
    return isinstance(value, str) and (value in PRESETS or (value.startswith(HF) and len(value) > len(HF)))


def _predicted(value: Any) -> bool:
    def numbers(item: Any) -> bool:
        return _number(item) or (isinstance(item, list) and all(_number(x) for x in item))

    return isinstance(value, dict) and all(numbers(item) for item in value.values())


def _quoted(choices: tuple[str, ...]) -> str:
    return ", ".join(json.dumps(c) for c in choices)


SCHEDULES: tuple[str, ...] = get_args(ScheduleName)
GATHERS: tuple[str, ...] = ("step", "micro-batch")
"""When FSDP gathers a stage's parameters (:data:`stagewise.plan.option.Gather`; train's ``fsdp_gather``)."""
OPTIMIZERS: tuple[str, ...] = get_args(OptimizerKind)
"""The optimizers train has (:data:`stagewise.run.Optimizer`, the same)."""
COUNT = "a whole number >= 1 (a JSON integer)"

FIELDS: tuple[PlanField, ...] = (
    PlanField(
        "model",
        "model",
        f'a preset ({_quoted(tuple(sorted(PRESETS)))}) or "hf:DIR" (a local Hugging Face folder)',
        _model,
        fix="name a preset or hf:DIR; a MODULE:FACTORY is given on the command line (--model)",
    ),
    PlanField("pp", "layout", COUNT, _count),
    PlanField("dp", "layout", COUNT, _count),
    PlanField("fsdp", "layout", COUNT, _count, required=False),
    PlanField("tp", "layout", COUNT, _count, required=False),
    PlanField("ep", "layout", COUNT, _count, required=False),
    PlanField("virtual", "layout", COUNT, _count),
    PlanField(
        "fsdp_gather",
        "layout",
        f"one of {_quoted(GATHERS)}",
        _one_of(GATHERS),
        required=False,
        fix=f"write one of {_quoted(GATHERS)}",
    ),
    PlanField(
        "offload_optimizer",
        "layout",
        "true or false (a JSON boolean)",
        lambda value: isinstance(value, bool),
        required=False,
        fix="write true or false, without quotes",
    ),
    PlanField("schedule", "schedule", f"one of {_quoted(SCHEDULES)}", _one_of(SCHEDULES)),
    PlanField("microbatches", "schedule", COUNT, _count),
    PlanField("batch_size", "schedule", COUNT, _count),
    PlanField("seq_len", "model", f"{COUNT} or null", _count, required=False, nullable=True),
    PlanField(
        "activation_checkpointing",
        "compute",
        'true, false or "selective"',
        lambda value: isinstance(value, bool) or value == "selective",
        required=False,
        fix='write true or false without quotes, or "selective"',
    ),
    PlanField(
        "offload_activations",
        "compute",
        "true or false (a JSON boolean)",
        lambda value: isinstance(value, bool),
        required=False,
        fix="write true or false, without quotes",
    ),
    PlanField(
        "optimizer",
        "optimizer",
        f"one of {_quoted(OPTIMIZERS)}, or null",
        _one_of(OPTIMIZERS),
        required=False,
        nullable=True,
        fix=f"write one of {_quoted(OPTIMIZERS)} (the optimizers train has)",
    ),
    PlanField(
        "partition",
        "layout",
        "a list of whole numbers (JSON integers) that starts at 0 and increases strictly",
        _bounds,
        fix="give the stage bounds of the layers, e.g. [0, 3, 7] for layers 0-2 and 3-6",
    ),
    PlanField(
        "schedule_text",
        "schedule",
        "a schedule's text (a JSON string, 'rank 0: 0F0 0B0 ...' per rank), or null",
        lambda value: isinstance(value, str),
        required=False,
        nullable=True,
    ),
    PlanField(
        "predicted",
        "predicted",
        "an object of numbers and lists of numbers (the planner's predictions)",
        _predicted,
        required=False,
    ),
)
"""The plan file's fields, in the order :meth:`~stagewise.plan.Plan.to_json` writes each section's; no other is
taken."""
_BY_NAME = {f.name: f for f in FIELDS}
SECTIONS: tuple[str, ...] = ("model", "layout", "schedule", "optimizer", "compute", "predicted")
"""The plan file's sections, in the order they are written: a job file's (:data:`stagewise.run.job.SECTIONS`),
and the planner's predictions."""


def sectioned(fields: Mapping[str, Any]) -> dict[str, Any]:
    """A plan's ``fields`` by name, as the plan file holds them: in their sections (the predictions as they are)."""
    out: dict[str, Any] = {}
    for section in SECTIONS:
        named = {f.name: fields[f.name] for f in FIELDS if f.section == section and f.name in fields}
        if section == "predicted" and "predicted" in named:
            out[section] = named["predicted"]
        elif named:
            out[section] = named
    return out


def _flattened(data: dict[str, Any]) -> dict[str, Any]:
    """The fields of a plan file's sections, by name; a section or a field out of its place is refused."""
    unknown = [name for name in data if name not in SECTIONS]
    if unknown:
        if any(name in _BY_NAME for name in unknown):
            raise ValueError(
                f"the plan holds {unknown} outside the sections a plan holds them in ({list(SECTIONS[:-1])}): an "
                f"earlier stagewise wrote it; {_REWRITE}"
            )
        raise ValueError(
            f"the plan has sections train does not know: {unknown}; a plan holds only {list(SECTIONS)}: remove "
            f"them, or {_REWRITE}"
        )
    fields: dict[str, Any] = {}
    for section, table in data.items():
        if section == "predicted":
            fields[section] = table
            continue
        if not isinstance(table, dict):
            raise refusal(section, table, "not a section (a JSON object of fields)")
        for name, value in table.items():
            spec = _BY_NAME.get(name)
            if spec is None:
                raise ValueError(
                    f'the plan has fields train does not know: ["{section}"]["{name}"]; a plan holds only '
                    f"{[f.name for f in FIELDS]}: remove them, or {_REWRITE}"
                )
            if spec.section != section:
                raise ValueError(
                    f'the plan holds "{name}" in "{section}", but it belongs in "{spec.section}"; {_REWRITE}'
                )
            fields[name] = value
    return fields


def shown(value: Any, limit: int = 60) -> str:
    """``value`` as the JSON it was written as, cut to ``limit`` characters with its length when longer."""
    text = json.dumps(value)
    return text if len(text) <= limit else f"{text[: limit - 3]}... ({len(text)} characters)"


def refusal(name: str, value: Any, what: str, fix: str = "") -> ValueError:
    """The one-line error for the plan field ``name`` holding ``value``: ``what`` is wrong, and ``fix`` mends it."""
    return ValueError(f'the plan\'s "{name}" is {shown(value)}, {what}; {fix or _REWRITE}')


def is_factory(model: str) -> bool:
    """Whether ``model`` names code: ``MODULE:FACTORY`` (not a preset, not ``hf:DIR``)."""
    module, _, factory = model.partition(":")
    return model not in PRESETS and not model.startswith(HF) and bool(module) and bool(factory)


def read_plan(path: str | Path, *, model: str | None = None) -> dict[str, Any]:
    """The plan in the file ``path``, read up to :data:`MAX_PLAN_BYTES` and checked (:func:`load_plan`)."""
    with Path(path).open("rb") as file:
        data = file.read(MAX_PLAN_BYTES + 1)
    if len(data) > MAX_PLAN_BYTES:
        raise ValueError(
            f"the plan {path} is larger than {MAX_PLAN_BYTES // 2**20} MiB, which no plan is; give the file that "
            "`stagewise plan --json PLAN` wrote"
        )
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"the plan {path} is not UTF-8 text ({err.reason} at byte {err.start}); {_REWRITE}") from None
    return load_plan(text, model=model)


def load_plan(text: str, *, model: str | None = None) -> dict[str, Any]:
    """A plan written by :meth:`~stagewise.plan.Plan.to_json`, every field checked against :data:`FIELDS`; returned
    by field name (out of its sections), each value as it was written.

    ``model``: the model the command line names (trusted, unlike the file); a plan that names this same
    ``MODULE:FACTORY`` is taken, any other factory refused.

    Raises:
        ValueError: one line naming the field, its value and the fix.
    """
    raw = _parsed(text)
    if "bounds" in raw and "layout" not in raw:
        raise ValueError(
            f"this is a partition (stagewise partition --json: the stage bounds {shown(raw['bounds'])} alone), not "
            "a plan, which also holds the model, the layout and the batch; write one with `stagewise plan --json "
            "PLAN`, or pass the bounds to train as TrainConfig(partition=...)"
        )
    data = _flattened(raw)
    missing = [f.name for f in FIELDS if f.required and f.name not in data]
    if missing:
        raise ValueError(f"the plan lacks {missing}; write it with `stagewise plan --json`")
    _check_factory(data["model"], model)
    for name, value in data.items():
        spec = _BY_NAME[name]
        if name == "model" and value == model:  # the command line's own model: trusted, and checked there
            continue
        if not ((value is None and spec.nullable) or spec.accepts(value)):
            raise refusal(name, value, f"not {spec.expects}", spec.fix)
    n_stages = data["pp"] * data["virtual"]
    if len(data["partition"]) != n_stages + 1:
        raise refusal(
            "partition", data["partition"],
            f"bounds of {len(data['partition']) - 1} stages, but pp x virtual = {data['pp']} x "
            f"{data['virtual']} = {n_stages}", f"give {n_stages + 1} bounds, or {_REWRITE}",
        )  # fmt: skip
    if data.get("schedule_text") is not None:
        check_schedule_text(data["schedule_text"], data["pp"], data["virtual"], data["microbatches"])
    return data


def _parsed(text: str) -> dict[str, Any]:
    """``text`` read as a JSON object, each name once."""

    def unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        names = [name for name, _ in pairs]
        twice = sorted({name for name in names if names.count(name) > 1})
        if twice:
            raise ValueError(f"the plan names {twice} more than once; keep one of each, or {_REWRITE}")
        return dict(pairs)

    try:
        data = json.loads(text, object_pairs_hook=unique)
    except json.JSONDecodeError as err:
        raise ValueError(
            f"the plan is not JSON ({err.msg} at line {err.lineno} column {err.colno}); {_REWRITE}"
        ) from None
    except RecursionError:
        raise ValueError(f"the plan nests lists or objects too deeply to be one; {_REWRITE}") from None
    except ValueError as err:  # a name given twice (said above), or a number of more digits than Python reads
        message = str(err).splitlines()[0]
        if message.startswith("the plan"):
            raise ValueError(message) from None
        raise ValueError(
            f"the plan holds a value that JSON allows but Python cannot read ({message.split(':')[0]}); {_REWRITE}"
        ) from None
    if not isinstance(data, dict):
        raise ValueError(
            f"the plan is {shown(data)}, a JSON {_JSON_TYPES.get(type(data), 'value')}, not an object of fields "
            f'("model": {{"model": ...}}, "layout": {{"pp": ...}}, ...); {_REWRITE}'
        )
    return data


def _check_factory(value: Any, trusted: str | None) -> None:
    """Refuse a plan's model that names code (``MODULE:FACTORY``), unless the command line names the same."""
    if not isinstance(value, str) or not is_factory(value) or value == trusted:
        return
    raise refusal(
        "model", value,
        "code (MODULE:FACTORY), which a plan file may not name: it would be imported and run in every process",
        f"give --model {value} on the command line to train it with this plan, or plan a preset or hf:DIR",
    )  # fmt: skip


def schedule_text_bound(stages: int, virtual: int, microbatches: int) -> tuple[int, int]:
    """The most actions and characters a schedule text of a layout may hold: ``pp x virtual x microbatches
    x`` :data:`ACTIONS_PER_MICROBATCH` actions, :data:`CHARS_PER_ACTION` characters each plus
    :data:`COMMENT_CHARS`, and never more than :data:`MAX_SCHEDULE_CHARS`."""
    actions = stages * virtual * microbatches * ACTIONS_PER_MICROBATCH
    return actions, min(MAX_SCHEDULE_CHARS, actions * CHARS_PER_ACTION + COMMENT_CHARS)


def check_schedule_text(text: str, stages: int, virtual: int, microbatches: int) -> Schedule:
    """``text`` read as the schedule of ``stages`` ranks holding ``virtual`` stages each over ``microbatches``
    micro-batches, its size bounded before it is parsed (:func:`schedule_text_bound`): each action's stage and
    micro-batch are read and checked first, so that no number in it allocates anything."""
    most, chars = schedule_text_bound(stages, virtual, microbatches)
    n_stages = stages * virtual
    if len(text) > chars:
        raise refusal(
            "schedule_text", text, f"longer than a schedule of {stages} x {virtual} stages and {microbatches} "
            f"micro-batches can be ({chars} characters)", f"give that layout's schedule, or {_REWRITE}",
        )  # fmt: skip
    count = 0
    for number, raw in enumerate(text.splitlines(), start=1):
        _, sep, body = raw.split("#", 1)[0].partition(":")
        if not sep:
            continue  # a comment, a blank line, or no line at all: the parser says which
        for token in body.split():
            count += 1
            try:
                action = Action.parse(token)
            except ValueError as err:
                raise refusal("schedule_text", text, f"unreadable at line {number}: {err}") from None
            if count > most:
                raise refusal(
                    "schedule_text", text,
                    f"more than the {most} actions a schedule of {n_stages} stages (pp x virtual) and "
                    f"{microbatches} micro-batches holds ({ACTIONS_PER_MICROBATCH} per stage and micro-batch)",
                    f"give that layout's schedule, or {_REWRITE}",
                )  # fmt: skip
            if action.stage >= n_stages or action.microbatch >= microbatches:
                raise refusal(
                    "schedule_text", text,
                    f"outside the plan's layout at line {number}: {action} runs stage {action.stage} and micro-batch "
                    f"{action.microbatch}, but the plan has stages 0 .. {n_stages - 1} (pp x virtual) and "
                    f"micro-batches 0 .. {microbatches - 1}", f"give that layout's schedule, or {_REWRITE}",
                )  # fmt: skip
    try:
        schedule = Schedule.from_text(text, name="planned")
    except ValueError as err:
        raise refusal("schedule_text", text, f"not a schedule: {err}") from None
    shape = (schedule.n_ranks, schedule.n_stages, schedule.n_microbatches)
    if shape != (stages, n_stages, microbatches):
        raise refusal(
            "schedule_text", text,
            f"a schedule of {shape[0]} ranks, {shape[1]} stages and {shape[2]} micro-batches, but the plan has "
            f"{stages} ranks (pp), {n_stages} stages (x virtual) and {microbatches} micro-batches",
            f"give that layout's schedule, or {_REWRITE}",
        )  # fmt: skip
    return schedule


def schema() -> Mapping[str, str]:
    """Each field of a plan file and what it must be, for documentation: ``{name: "expects (optional)"}``."""
    return {f.name: f.expects + ("" if f.required else " (optional)") for f in FIELDS}
