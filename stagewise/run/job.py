"""The job file: a run's settings as TOML, in sections, each key the name of a :class:`TrainConfig` field and its flag.

``stagewise train --config run.toml`` reads one, flags given on the command line override it, and
``--print-config`` prints the settings a run resolves to in the same form; every run's folder keeps its own as
``config.toml``. The sections only group the keys: a key is the field's name, and its flag is the same name
with dashes (``batch_size``: ``--batch-size``). A key left out takes its default; ``false`` turns off a setting
that is otherwise a path or a number (``checkpoint_dir = false``: no checkpoints). The plan file
(``stagewise plan --json``) holds the same sections for what it chooses.

A job file is data: it is parsed as TOML, each value checked against its field's type, and it names no code:
its model is a preset or ``hf:DIR``; a ``MODULE:FACTORY`` in it is refused unless the command line's ``--model``
names the same one (as for a plan file).
"""

from __future__ import annotations

import dataclasses
import sys
import types
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

from stagewise.errors import StagewiseError, is_whole
from stagewise.models import GPTConfig
from stagewise.plan.plan_file import is_factory, read_plan
from stagewise.run.config import TrainConfig
from stagewise.run.user_model import UserModel, model_of
from stagewise.units import parse_bytes

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

SECTIONS: Mapping[str, tuple[str, ...]] = {
    "model": ("model", "seq_len", "seed"),
    "data": ("data", "tokenizer", "data_field", "data_column", "data_limit", "document_masking"),
    "layout": ("pp", "dp", "fsdp", "tp", "ep", "virtual", "partition", "fsdp_gather", "offload_optimizer"),
    "schedule": ("schedule", "schedule_text", "microbatches", "batch_size"),
    "optimizer": ("optimizer", "lr", "warmup", "steps", "clip"),
    "compute": (
        "bf16",
        "activation_checkpointing",
        "offload_activations",
        "compile",
        "weight_gradient_fusion",
        "weight_gradient_pool",
    ),
    "evaluation": ("eval_every", "eval_batches"),
    "checkpoints": ("checkpoint_dir", "checkpoint_every", "checkpoint_async", "verify_checksums", "resume"),
    "logging": ("metrics", "tensorboard", "wandb", "log_every", "trace"),
    "run": ("stop_after", "timeout", "nonfinite"),
}
"""The job file's sections and, in order, the keys each holds: every field of :class:`TrainConfig` once."""

SECTION_OF: Mapping[str, str] = {key: section for section, keys in SECTIONS.items() for key in keys}
"""The section each key belongs to."""

MAX_JOB_BYTES = 1 << 20
"""The largest job file read (a job file is some hundred bytes; a planned schedule's text some KiB)."""


class JobFileError(StagewiseError, ValueError):
    """A job file that cannot be read, or that holds a key or value no run takes; the message names it."""


def job_text(values: Mapping[str, Any]) -> str:
    """The job file of ``values`` (a :class:`TrainConfig`'s fields by name; those left out are not written), in
    the sections' order; a setting that is off (None) is ``false`` where its default is on, else left out."""
    import tomli_w

    defaults = {f.name: f.default for f in dataclasses.fields(TrainConfig)}
    unknown = sorted(set(values) - set(SECTION_OF))
    if unknown:
        raise ValueError(f"{unknown} are not settings of a run; the settings are {sorted(SECTION_OF)}")
    document: dict[str, dict[str, Any]] = {}
    for section, keys in SECTIONS.items():
        table: dict[str, Any] = {}
        for key in keys:
            if key not in values or (values[key] is None and defaults[key] is None):
                continue
            value = values[key]
            table[key] = False if value is None else list(value) if isinstance(value, tuple) else value
        if table:
            document[section] = table
    return tomli_w.dumps(document, multiline_strings=True)


def config_text(config: TrainConfig) -> str:
    """The job file of every setting of ``config``."""
    return job_text({f.name: getattr(config, f.name) for f in dataclasses.fields(config)})


def read_job(path: str | Path) -> dict[str, Any]:
    """The settings the job file ``path`` gives, by field name, each checked against its field's type (ranges are
    checked by :class:`TrainConfig` once every setting is known)."""
    where = Path(path)
    try:
        with where.open("rb") as file:
            raw = file.read(MAX_JOB_BYTES + 1)
    except OSError as err:
        raise JobFileError(
            f"cannot read the job file {where} ({err.strerror or err}); give a readable TOML file"
        ) from err
    if len(raw) > MAX_JOB_BYTES:
        raise JobFileError(f"{where} is over {MAX_JOB_BYTES} bytes, too large for a job file; is it the right file?")
    try:
        document = tomllib.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, tomllib.TOMLDecodeError) as err:
        raise JobFileError(
            f"{where} is not a TOML file ({err}); write it as `stagewise train --print-config` does"
        ) from None
    return job_values(document, str(where))


def job_values(document: Mapping[str, Any], source: str) -> dict[str, Any]:
    """The settings of a parsed job file (or a plan's sections), by field name, each checked against its type."""
    values: dict[str, Any] = {}
    for section, table in document.items():
        if section not in SECTIONS:
            raise JobFileError(
                f"{source}: [{section}] is not a section of a job file; the sections are {list(SECTIONS)}"
            )
        if not isinstance(table, Mapping):
            raise JobFileError(f"{source}: {section} must be a section ([{section}]) of keys, got {table!r}")
        for key, value in table.items():
            if key not in SECTION_OF:
                raise JobFileError(
                    f"{source}: [{section}] {key} is not a setting; [{section}] takes {list(SECTIONS[section])}"
                )
            if SECTION_OF[key] != section:
                raise JobFileError(f"{source}: {key} belongs in [{SECTION_OF[key]}], not [{section}]; move it there")
            values[key] = _checked(key, value, f"{source}: [{section}] {key}")
    return values


_HINTS = get_type_hints(TrainConfig)


def _checked(key: str, value: Any, where: str) -> Any:
    """``value`` as field ``key`` takes it: refused in one line unless it has the field's type."""
    hint = _HINTS[key]
    choices = [a for a in (get_args(hint) if _is_union(hint) else (hint,)) if a is not type(None)]
    optional = len(choices) < len(get_args(hint)) if _is_union(hint) else False
    if value is False and optional:
        return None  # off
    if key == "data_limit" and isinstance(value, str):
        try:
            return int(parse_bytes(value))
        except ValueError as err:
            raise JobFileError(f"{where}: {err}") from err
    for choice in choices:
        taken = _as(choice, value)
        if taken is not _REFUSED:
            return taken
    raise JobFileError(f"{where} = {value!r} is not {_described(choices, optional)}")


_REFUSED = object()


def _is_union(hint: Any) -> bool:
    return get_origin(hint) in (Union, types.UnionType)


def _as(kind: Any, value: Any) -> Any:
    """``value`` as a ``kind`` (a type, a Literal or a tuple of ints), or :data:`_REFUSED`."""
    if get_origin(kind) is Literal:
        return value if value in get_args(kind) and not isinstance(value, bool) else _REFUSED
    if get_origin(kind) is tuple:
        ok = isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
        return tuple(value) if ok else _REFUSED
    if kind is bool:
        return value if isinstance(value, bool) else _REFUSED
    if kind is int:
        return value if is_whole(value) else _REFUSED
    if kind is float:
        return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else _REFUSED
    if kind is str:
        return value if isinstance(value, str) else _REFUSED
    return _REFUSED


def _described(choices: list[Any], optional: bool) -> str:
    names = []
    for kind in choices:
        if get_origin(kind) is Literal:
            names.append("one of " + ", ".join(repr(a) for a in get_args(kind)))
        elif get_origin(kind) is tuple:
            names.append("a list of whole numbers")
        else:
            names.append({bool: "true or false", int: "a whole number", float: "a number", str: "a string"}[kind])
    return " or ".join(names) + (" (or false: off)" if optional else "")


LANGUAGE_ONLY = ("seq_len", "data", "tokenizer", "data_field", "data_column", "data_limit", "document_masking")
"""Settings that only a language model reads: given for another model, they are refused."""


def resolved(
    given: Mapping[str, Any],
    *,
    defaults: Mapping[str, Any] | None = None,
    job_file: str | Path | None = None,
    plan_file: str | Path | None = None,
) -> TrainConfig:
    """The settings of a run: ``defaults`` (over :class:`TrainConfig`'s own), then the job file, then the plan,
    then ``given`` (the flags on the command line), each overriding the ones before.

    A plan sets the layout it chose (:mod:`stagewise.plan.plan_file`): a flag given with another value than the
    plan's is refused, so that a run never trains a layout other than the one it was told. A plan naming code
    (``MODULE:FACTORY``) is taken only when the command line names the same model.
    """
    values: dict[str, Any] = dict(defaults or {})
    if job_file is not None:
        from_file = read_job(job_file)
        _refuse_code(from_file.get("model"), given.get("model"), job_file)
        values.update(from_file)
    if plan_file is not None:
        values.update(_planned(read_plan(plan_file, model=given.get("model")), given))
    values.update(given)
    model = values.get("model", TrainConfig.model)
    off_text = [key for key in LANGUAGE_ONLY if key in given or (job_file is not None and key in values)]
    if off_text and not isinstance(model_of(model), (GPTConfig, UserModel)):
        flag = "--" + off_text[0].replace("_", "-")
        raise ValueError(
            f"{flag} applies to language models, which read text; {model} trains on data of its own: "
            f"leave {flag} out, or choose a gpt-* model"
        )
    if values.get("checkpoint_every") and values.get("checkpoint_dir", TrainConfig.checkpoint_dir) is None:
        raise ValueError(
            f"--checkpoint-every {values['checkpoint_every']} saves checkpoints, but --no-checkpoints writes none "
            "(checkpoint_dir = false); leave one of them out"
        )
    return TrainConfig(**values)


def _refuse_code(model: object, trusted: object, job_file: str | Path) -> None:
    """Refuse a job file's model that names code (``MODULE:FACTORY``, which every rank would import and run),
    unless the command line names the same one."""
    if isinstance(model, str) and is_factory(model) and model != trusted:
        raise JobFileError(
            f"{job_file}: [model] model = {model!r} names code (MODULE:FACTORY), which a job file may not: it would "
            f"be imported and run on every rank; give --model {model} on the command line to train it with this "
            "file, or name a preset or hf:DIR"
        )


def _planned(plan: Mapping[str, Any], given: Mapping[str, Any]) -> dict[str, Any]:
    """The settings a plan makes (checked field by field by :func:`~stagewise.plan.plan_file.load_plan`), under
    their own names; a setting ``given`` with another value than the plan's is refused."""
    planned = {key: value for key, value in plan.items() if key != "predicted" and value is not None}
    planned["partition"] = tuple(planned["partition"])
    clashes = [
        f"--{key.replace('_', '-')} {given[key]} (the plan's: {value})"
        for key, value in planned.items()
        if key in given and given[key] != value
    ]
    if clashes:
        raise ValueError(
            f"--plan sets the layout, but {', '.join(clashes)} asks for another; leave those flags out to train "
            "the plan, or plan again with them (stagewise plan --json)"
        )
    return planned
