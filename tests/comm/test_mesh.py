"""init_mesh() and Layout: ranks map to (stage, replica) with the pipeline outermost."""

from __future__ import annotations

import datetime
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist
from support.multiproc import run_ranks

from stagewise.comm import LaunchError, Layout, PipelineMesh, init_mesh
from stagewise.comm.layout import Coords


def test_layout_is_pipeline_outermost() -> None:
    layout = Layout(pp=2, dp=3)
    assert [layout.coords(r) for r in range(6)] == [
        Coords(0, 0),
        Coords(0, 1),
        Coords(0, 2),
        Coords(1, 0),
        Coords(1, 1),
        Coords(1, 2),
    ]
    assert layout.rank(1, 2) == 5
    assert layout.next_rank(1) == 4 and layout.prev_rank(4) == 1
    assert layout.next_rank(4) is None and layout.prev_rank(2) is None
    assert layout.pipeline_ranks(1) == (1, 4) and layout.replica_ranks(1) == (3, 4, 5)


@pytest.mark.parametrize(
    ("args", "error", "pattern"),
    [
        ((0, 1), ValueError, r"pp must be >= 1, got 0"),
        ((2, 0), ValueError, r"dp must be >= 1, got 0"),
        ((2.0, 1), TypeError, r"pp must be a whole number, got 2.0"),
    ],
)
def test_bad_layout(args: tuple[object, object], error: type[Exception], pattern: str) -> None:
    with pytest.raises(error, match=pattern):
        Layout(*args)  # type: ignore[arg-type]


def test_layout_range_checks() -> None:
    with pytest.raises(ValueError, match=r"rank 4 is outside a pp=2 x dp=2 mesh of 4"):
        Layout(2, 2).coords(4)
    with pytest.raises(ValueError, match=r"\(stage 2, replica 0\) is outside"):
        Layout(2, 2).rank(2, 0)


def test_a_backend_that_cannot_run_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    # "glo" ended in torch's AssertionError, and "nccl" on a machine without GPUs in an AttributeError.
    with pytest.raises(
        ValueError, match=r"backend must be one of \['gloo', 'nccl'\] or None \(chosen for you\), got 'glo'"
    ):
        init_mesh(1, backend="glo")  # type: ignore[arg-type]
    if torch.cuda.is_available():
        return  # the refusal below is for machines without a GPU
    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999"}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(
        ValueError, match=r"backend 'nccl' needs a CUDA device for local rank 0, but this machine has 0"
    ):
        init_mesh(1, backend="nccl")
    assert not dist.is_initialized()


def test_init_mesh_outside_torchrun(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(
        ValueError, match=r"needs the torchrun environment, but RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT are not set"
    ):
        init_mesh(1)


def mesh_of_rank(pp: int, dp: int) -> tuple[object, ...]:
    mesh = init_mesh(pp, dp, timeout=30)
    pp_ranks = dist.get_process_group_ranks(mesh.pp_group)
    dp_ranks = dist.get_process_group_ranks(mesh.dp_group)
    out = (
        mesh.coords,
        mesh.prev_rank,
        mesh.next_rank,
        pp_ranks,
        dp_ranks,
        mesh.backend,
        str(mesh.device),
        mesh.describe(),
    )
    dist.destroy_process_group()
    return out


def test_two_by_two_mesh() -> None:
    results = run_ranks(mesh_of_rank, 4, 2, 2)
    expected = {
        0: (Coords(0, 0), None, 2, [0, 2], [0, 1]),
        1: (Coords(0, 1), None, 3, [1, 3], [0, 1]),
        2: (Coords(1, 0), 0, None, [0, 2], [2, 3]),
        3: (Coords(1, 1), 1, None, [1, 3], [2, 3]),
    }
    for rank, value in results.items():
        assert value[:5] == expected[rank]
        assert value[5] == "gloo" and value[6] == "cpu"
        assert f"pp=2 x dp=2 on 4 processes; rank {rank} is stage {rank // 2}, replica {rank % 2}" in str(value[7])


def late_replica(world_first: bool) -> str:
    """Rank 3 is late; its partners wait for it: rank 2 in its replica group, rank 1 in its pipeline (on a 4 x 1
    mesh, rank 0 in the pipeline that is the world)."""
    if world_first:  # the default group made beforehand, with a longer bound than the mesh's
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=40))
    mesh = init_mesh(2, 2, timeout=2) if not world_first else init_mesh(4, 1, timeout=2)
    if mesh.rank == 3:
        time.sleep(4.5)  # past the mesh's timeout
        return "late"
    group = {2: mesh.dp_group, 1: mesh.pp_group} if not world_first else {0: mesh.pp_group}
    if mesh.rank not in group:
        return "not a partner"
    began = time.monotonic()
    try:
        dist.all_reduce(torch.ones(1), group=group[mesh.rank])
        outcome = "done"
    except RuntimeError:
        outcome = "timed out"
    waited = time.monotonic() - began
    return f"{outcome} after {'less' if waited < 4 else 'more'} than 4 s"


@pytest.mark.parametrize("world_first", [False, True])
def test_the_mesh_timeout_bounds_both_dimensions(world_first: bool) -> None:
    # init_device_mesh gave a dimension that is not the whole world torch's default 30-minute timeout, so a late
    # replica held DDP's all-reduce far past the mesh's timeout instead of failing; and a dimension spanning the
    # world must not take a default group made beforehand with another bound.
    results = run_ranks(late_replica, 4, world_first, timeout=60)
    partners = (0,) if world_first else (1, 2)  # pipeline and replica partners of rank 3
    for rank in partners:
        assert results[rank] == "timed out after less than 4 s", (rank, results)


def test_wrong_world_size_is_refused() -> None:
    with pytest.raises(LaunchError) as info:
        run_ranks(mesh_of_rank, 3, 2, 2)
    assert "pp=2 x dp=2 = 4 processes, but the world size is 3" in info.value.failures[0].message


@pytest.mark.parametrize(
    ("pp", "dp", "pattern"),
    [
        (None, 3, r"dp=3 does not divide the world size 4, so no pp fits; choose dp among \[1, 2, 4\]"),
        (3, None, r"pp=3 does not divide the world size 4, so no dp fits; choose pp among \[1, 2, 4\]"),
        (None, 0, r"dp must be >= 1, got 0"),
        (2, 3, r"pp=2 x dp=3 = 6 processes, but the world size is 4"),
    ],
)
def test_a_dimension_that_does_not_fit_the_world_is_refused(
    monkeypatch: pytest.MonkeyPatch, pp: int | None, dp: int | None, pattern: str
) -> None:
    # The layout is checked against WORLD_SIZE before any process group is created.
    for name, value in (("RANK", "0"), ("WORLD_SIZE", "4"), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "1")):
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=pattern):
        init_mesh(pp, dp)
    assert not dist.is_initialized()


def inferred_layout(pp: int | None, dp: int | None) -> tuple[int, int]:
    mesh = init_mesh(pp, dp, timeout=30)
    dist.destroy_process_group()
    return mesh.layout.pp, mesh.layout.dp


def test_a_missing_dimension_is_inferred_from_the_world_size() -> None:
    assert run_ranks(inferred_layout, 4, None, 2) == dict.fromkeys(range(4), (2, 2))


def test_a_four_dimensional_layout_puts_tensor_parallelism_innermost() -> None:
    layout = Layout(pp=2, dp=1, fsdp=2, tp=2)
    assert layout.coords(5) == Coords(stage=1, replica=0, shard=0, tp_rank=1)
    assert layout.rank(1, 0, 1, 0) == 6
    assert layout.lines == 4 and layout.batch_shards == 2
    assert layout.pipeline_ranks(layout.line(5)) == (1, 5)  # the same shard and tp rank on each stage
    assert [layout.batch_index(r) for r in range(4)] == [0, 0, 1, 1]  # tp ranks take the same share
    assert layout.describe() == "pp=2 x dp=1 x fsdp=2 x tp=2"


def test_a_sharded_layout_that_does_not_fit_the_world_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    env = {"RANK": "0", "WORLD_SIZE": "4", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29998"}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(
        ValueError,
        match=r"^pp=2 x fsdp=3 x tp=1 does not divide the world size 4, so no dp fits; choose fsdp x tp among the "
        r"divisors \[1, 2, 4\], or launch a multiple of 6 processes$",
    ):
        init_mesh(2, None, fsdp=3)
    with pytest.raises(
        ValueError,
        match=r"^pp=2 x dp=2 x fsdp=2 x tp=1 = 8 processes, but the world size is 4; choose pp, dp, fsdp and tp "
        r"whose product is 4, or launch 8 processes$",
    ):
        init_mesh(2, 2, fsdp=2)
    with pytest.raises(ValueError, match=r"^tp must be >= 1, got 0; give 1 or more ranks \(1: not split\)$"):
        init_mesh(2, None, tp=0)
    assert not dist.is_initialized()


def test_each_pipeline_takes_its_share_of_the_global_batch() -> None:
    layout = Layout(pp=2, dp=1, fsdp=2, tp=2)
    cpu = torch.device("cpu")
    shares = [PipelineMesh(None, layout, r, cpu, "gloo", 1.0, None).share(8) for r in range(8)]  # type: ignore[arg-type]
    assert shares[4:] == [slice(0, 4), slice(0, 4), slice(4, 8), slice(4, 8)]  # tp ranks take the same share
    with pytest.raises(
        ValueError, match=r"^a global batch of 7 does not divide into the 2 shares of dp x fsdp = 1 x 2"
    ):
        PipelineMesh(None, layout, 0, cpu, "gloo", 1.0, None).share(7)  # type: ignore[arg-type]


def test_expert_parallelism_borrows_consecutive_ranks_of_fsdp_or_else_dp() -> None:
    # pp2 x fsdp4, ep2: the grid reshaped, each stage's 4 shards cut into 2 groups of 2 consecutive ranks.
    assert Layout(2, 1, 4, 1, ep=2).expert_shape == (2, 1, 2, 2, 1)
    # dp4 without fsdp, ep4: all 4 replicas split the experts; one copy of each.
    assert Layout(1, 4, 1, 2, ep=4).expert_shape == (1, 1, 1, 4, 2)
    assert "(ep=2)" in Layout(2, 2, ep=2).describe()
    with pytest.raises(ValueError) as err:
        Layout(2, 2, 1, 1, ep=4)
    assert str(err.value) == (
        "ep=4 does not divide dp=2: expert parallelism borrows its ranks from fsdp (or, with fsdp=1, from dp); "
        "choose ep among [1, 2], or give dp a multiple of 4"
    )
    with pytest.raises(ValueError, match=r"^ep=3 does not divide fsdp=4: .* choose ep among \[1, 2, 4\]"):
        Layout(1, 2, 4, 1, ep=3)


def expert_groups_of_rank(pp: int, dp: int, fsdp: int, ep: int) -> dict[str, Any]:
    mesh = init_mesh(pp, dp, fsdp=fsdp, ep=ep, timeout=30)
    assert mesh.experts is not None
    groups = mesh.experts
    out = {
        "ep": dist.get_process_group_ranks(groups.ep),
        "backward": dist.get_process_group_ranks(groups.backward),
        "replicas": dist.get_process_group_ranks(groups.replicas),
        # The backward's all-to-alls may run beside the forward's: never on the same group, nor the default one.
        "backward_apart": groups.backward is not groups.ep and groups.backward is not dist.group.WORLD,
        "mesh": groups.mesh.mesh.tolist(),
    }
    mesh.close()
    dist.destroy_process_group()
    return out


@pytest.mark.timeout(120)
def test_expert_groups_are_consecutive_data_ranks_and_the_backward_has_a_group_of_its_own() -> None:
    got = run_ranks(expert_groups_of_rank, 4, 1, 1, 4, 2)  # fsdp4, ep2: shards (0, 1) and (2, 3) split the experts
    for rank, groups in got.items():
        pair = [rank - rank % 2, rank - rank % 2 + 1]
        assert groups["ep"] == groups["backward"] == groups["mesh"] == pair
        assert groups["replicas"] == [rank % 2, rank % 2 + 2]  # the ranks holding the same experts
        assert groups["backward_apart"]
    got = run_ranks(expert_groups_of_rank, 2, 1, 2, 1, 2)  # ep is the world: its backward group is still its own
    assert all(g["ep"] == [0, 1] and g["backward_apart"] and g["replicas"] == [r] for r, g in got.items())
