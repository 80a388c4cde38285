"""Partition.split_spec(): torch's pipeline() cuts a chain exactly where the partition does."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.pipelining import SplitPoint, pipeline

from stagewise.models import build
from stagewise.partition import Partition, auto, layers_of
from stagewise.pipeline import materialise_model


def test_torch_pipeline_splits_where_the_partition_does() -> None:
    model = materialise_model(build("gpt-tiny", device="meta"), seed=1)
    x = torch.randint(0, 256, (2, 16))
    part = auto(model, 3, x, by="flops")
    spec = part.split_spec(model)
    names = [layer.name for layer in layers_of(model)]
    assert spec == {names[b]: SplitPoint.BEGINNING for b in part.bounds[1:-1]}
    pipe = pipeline(model, mb_args=(x,), split_spec=spec)
    assert pipe.num_stages == part.n_stages
    for stage in range(part.n_stages):
        held = {".".join(n.split(".")[:2]) for n, _ in pipe.get_stage_module(stage).named_parameters()}
        owners = {names[i] for i in part.layers(stage)}
        # every parameter of torch's stage belongs to one of this partition's layers for that stage
        assert all(any(h == o or h.startswith(o + ".") for o in owners) for h in held), (stage, held, owners)
    out = pipe(x)
    torch.testing.assert_close(out[0] if isinstance(out, tuple) else out, model(x))


def test_a_partition_of_another_model_is_refused() -> None:
    with pytest.raises(ValueError, match=r"this partition splits 3 layers but the model has 7"):
        Partition.from_bounds((0, 1, 3)).split_spec(build("gpt-tiny", device="meta"))
