"""The plan file's schema: a plan that `stagewise plan --json` writes is read as written; any other value is refused
in one line that names the field, the value and the fix, before anything is built from it."""

from __future__ import annotations

import json
import tracemalloc
from pathlib import Path
from typing import Any, get_args

import pytest
import torch
from torch import nn

from stagewise.plan import plan, workload
from stagewise.plan.cluster import Cluster, Device
from stagewise.plan.plan_file import FIELDS, HF, MAX_PLAN_BYTES, OPTIMIZERS, load_plan, read_plan, schema, sectioned
from stagewise.run import Optimizer
from stagewise.run.user_model import HF as RUN_HF
from stagewise.schedule import build

GiB = 2**30


def written(**fields: Any) -> dict[str, Any]:
    """What `stagewise plan --json` writes for two stages of gpt-tiny, with ``fields`` changed (None: left out)."""
    base: dict[str, Any] = {
        "model": "gpt-tiny", "pp": 2, "dp": 1, "fsdp": 1, "tp": 1, "virtual": 1, "schedule": "1f1b",
        "microbatches": 4, "batch_size": 8, "seq_len": 32, "activation_checkpointing": False, "optimizer": "adamw",
        "partition": [0, 3, 7], "predicted": {"step_time": 0.5, "bubble": 0.2, "rank_memory": [1.0, 2.0],
                                              "rank_activation": [0.5, 0.5]},
    }  # fmt: skip
    base.update(fields)
    return {k: v for k, v in base.items() if v is not None}


def text(**fields: Any) -> str:
    return json.dumps(sectioned(written(**fields)))


def test_a_plan_round_trips_unchanged() -> None:
    model = nn.Sequential(*(nn.Linear(64, 64) for _ in range(6)))
    work = workload(model, torch.randn(2, 64), global_batch=8)
    result = plan(work, Cluster((Device(GiB, 1e12),) * 2))
    best = result.best
    assert best is not None
    schedule = build(best.schedule, best.pp * best.n_virtual, best.n_microbatches, n_virtual=best.n_virtual)
    extras: list[dict[str, Any]] = [{}, {"schedule_text": schedule.to_text()}, {"optimizer": "sgd", "seq_len": 16}]
    for extra in extras:
        out = result.to_json(work, **{"model": "gpt-tiny", "seq_len": None, **extra})
        assert sectioned(load_plan(out)) == json.loads(out)
    old = written(fsdp=None, tp=None, seq_len=None, optimizer=None, activation_checkpointing=None, predicted=None)
    assert load_plan(json.dumps(sectioned(old))) == old  # plans without the optional fields


def test_the_schema_is_trains_own() -> None:
    assert get_args(Optimizer) == OPTIMIZERS and HF == RUN_HF
    assert list(schema()) == [f.name for f in FIELDS]
    assert schema()["optimizer"] == 'one of "adamw", "sgd", or null (optional)'


@pytest.mark.parametrize(
    ("plan_text", "message"),
    [
        (text(optimizer="lion"), 'the plan\'s "optimizer" is "lion", not one of "adamw", "sgd", or null; write one '
         'of "adamw", "sgd" (the optimizers train has)'),
        (text(activation_checkpointing="no"), 'the plan\'s "activation_checkpointing" is "no", not true, false or '
         '"selective"; write true or false without quotes, or "selective"'),
        (text(fsdp_gather="always"), 'the plan\'s "fsdp_gather" is "always", not one of "step", "micro-batch"; write '
         'one of "step", "micro-batch"'),
        (text(offload_optimizer="yes"), 'the plan\'s "offload_optimizer" is "yes", not true or false (a JSON '
         "boolean); write true or false, without quotes"),
        (text(offload_activations=1), 'the plan\'s "offload_activations" is 1, not true or false (a JSON boolean)'),
        (text(partition=[0, 2.5, 7]), 'the plan\'s "partition" is [0, 2.5, 7], not a list of whole numbers (JSON '
         "integers) that starts at 0 and increases strictly; give the stage bounds"),
        (text(partition=[0, 3, 3]), 'the plan\'s "partition" is [0, 3, 3], not a list of whole numbers'),
        (text(partition=[0, 3]), 'the plan\'s "partition" is [0, 3], bounds of 1 stages, but pp x virtual = 2 x '
         "1 = 2; give 3 bounds"),
        (text(pp=True), 'the plan\'s "pp" is true, not a whole number >= 1 (a JSON integer); write the plan '
         "again with `stagewise plan --json PLAN`"),
        (text(microbatches=0), 'the plan\'s "microbatches" is 0, not a whole number >= 1'),
        (text(schedule="round-robin"), 'the plan\'s "schedule" is "round-robin", not one of "gpipe", "1f1b"'),
        (text(schedule_text=5), 'the plan\'s "schedule_text" is 5, not a schedule\'s text (a JSON string'),
        (text(schedule_text="rank 0: 3000000000F0"), 'the plan\'s "schedule_text" is "rank 0: 3000000000F0", outside '
         "the plan's layout at line 1: 3000000000F0 runs stage 3000000000 and micro-batch 0, but the plan has stages "
         "0 .. 1"),
        (text(schedule_text="rank 0: 0F0 " * 10**5), 'the plan\'s "schedule_text" is "rank 0: 0F0 rank 0: 0F0 rank '
         "0: 0F0 rank 0: 0F0 rank 0: ... (1200002 characters), longer than a schedule of 2 x 1 stages and 4 "
         "micro-batches can be (4864 characters)"),
        (text(schedule_text="rank 0: " + "0F0 " * 30), '"schedule_text" is "rank 0: 0F0 0F0 0F0 0F0 0F0 0F0 0F0 '
         "0F0 0F0 0F0 0F0 0F0 ... (130 characters), more than the 24 actions a schedule of 2 stages"),
        (text(schedule_text="rank 0: 0F0 0B0\n"), '"schedule_text" is "rank 0: 0F0 0B0\\n", a schedule of 1 ranks, 1 '
         "stages and 1 micro-batches, but the plan has 2 ranks (pp), 2 stages (x virtual) and 4 micro-batches"),
        (text(schedule_text="rank 0: 0X0"), 'the plan\'s "schedule_text" is "rank 0: 0X0", unreadable at line 1: '
         "cannot read action '0X0'"),
        (text(model="mypackage.models:make"), 'the plan\'s "model" is "mypackage.models:make", code '
         "(MODULE:FACTORY), which a plan file may not name: it would be imported and run in every process; give "
         "--model mypackage.models:make on the command line to train it with this plan, or plan a preset or hf:DIR"),
        (text(model="gpt-huge"), 'the plan\'s "model" is "gpt-huge", not a preset ('),
        (json.dumps({"optimizer": {"optimiser": "sgd"}}), 'the plan has fields train does not know: '
         '["optimizer"]["optimiser"]; a plan holds only [\'model\''),
        (json.dumps({**sectioned(written()), "optimiser": {}}), "the plan has sections train does not know: "
         "['optimiser']"),
        (json.dumps(written()), "the plan holds ['pp', 'dp', 'fsdp', 'tp', 'virtual', 'microbatches', 'batch_size', "
         "'seq_len', 'activation_checkpointing', 'partition'] outside the sections a plan holds them in (['model', "
         "'layout', 'schedule', 'optimizer', 'compute']): an earlier stagewise wrote it; write the plan again"),
        (json.dumps({"layout": {"schedule": "1f1b"}}), 'the plan holds "schedule" in "layout", but it belongs in '
         '"schedule"'),
        ('"gpt-tiny"', 'the plan is "gpt-tiny", a JSON string, not an object of fields ("model": {"model": ...}, '
         '"layout": {"pp": ...}, ...); '
         "write the plan again"),
        ("[1, 2]", "the plan is [1, 2], a JSON array, not an object of fields"),
        ("{'model': 1}", "the plan is not JSON (Expecting property name enclosed in double quotes at line 1 column "
         "2); write the plan again"),
        ("[" * 10**5, "the plan nests lists or objects too deeply to be one"),
        ('{"model": "gpt-tiny", "model": "mlp-tiny"}', "the plan names ['model'] more than once; keep one of each"),
        (text(pp=0).replace('"pp": 0', '"pp": ' + "9" * 5000),
         "the plan holds a value that JSON allows but Python cannot read (Exceeds the limit (4300 digits) for "
         "integer string conversion); write the plan again"),
        (json.dumps({"bounds": [0, 2, 4]}), "this is a partition (stagewise partition --json: the stage bounds "
         "[0, 2, 4] alone), not a plan"),
        (json.dumps({"model": {"model": "gpt-tiny"}}), "the plan lacks ['pp', 'dp', 'virtual', 'schedule', "
         "'microbatches'"),
    ],
    ids=lambda case: None if case.startswith(("{", "[", '"')) else case[:50],
)  # fmt: skip
def test_a_bad_plan_is_refused_in_one_line_naming_the_field_the_value_and_the_fix(plan_text: str, message: str) -> None:
    with pytest.raises(ValueError) as info:
        load_plan(plan_text)
    assert str(info.value).startswith(message) or message in str(info.value), str(info.value)
    assert "\n" not in str(info.value) and len(str(info.value)) < 600, str(info.value)


def test_a_huge_stage_number_is_refused_before_it_allocates() -> None:
    # Schedule.from_text makes a placement entry per stage up to the largest named: 3e9 of them here.
    tracemalloc.start()
    try:
        with pytest.raises(ValueError, match="outside the plan's layout at line 2: 3000000000F0"):
            load_plan(text(schedule_text="# a schedule\nrank 0: 0F0 3000000000F0\nrank 1: 1F0"))
        assert tracemalloc.get_traced_memory()[1] < 2**20
    finally:
        tracemalloc.stop()


def test_a_factory_is_taken_only_from_the_command_line() -> None:
    plan_text = text(model="mypackage.models:make")
    assert load_plan(plan_text, model="mypackage.models:make")["model"] == "mypackage.models:make"
    with pytest.raises(ValueError, match=r'"model" is "mypackage\.models:make", code'):
        load_plan(plan_text, model="other:make")
    assert load_plan(text(model="hf:/models/gpt2"))["model"] == "hf:/models/gpt2"


def test_a_plan_file_too_large_to_be_one_is_not_read_whole(tmp_path: Path) -> None:
    big = tmp_path / "plan.json"
    big.write_text(" " * (MAX_PLAN_BYTES + 1))
    with pytest.raises(ValueError, match=r"the plan .*plan.json is larger than 8 MiB, which no plan is"):
        read_plan(big)
    binary = tmp_path / "binary.json"
    binary.write_bytes(b"\xff\xfe{}")
    with pytest.raises(ValueError, match=r"binary.json is not UTF-8 text \(invalid start byte at byte 0\)"):
        read_plan(binary)
    good = tmp_path / "good.json"
    good.write_text(text())
    assert read_plan(good) == written()
