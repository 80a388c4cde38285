"""plan(top=K): the K fastest layouts as the whole search ranks them; the others skipped only by sound bounds."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stagewise.models import preset
from stagewise.partition import LayerCost
from stagewise.partition.layers import SharedParameter
from stagewise.plan import Plan, plan, workload
from stagewise.plan.bounds import can_fit, pipeline_floor, step_floor
from stagewise.plan.cluster import Cluster, Device
from stagewise.plan.evaluate import evaluate, overheads, partitioned, timed
from stagewise.plan.planner import candidates, tensor_parallel_degrees
from stagewise.plan.rejection import Rejection
from stagewise.plan.setting import Settings
from stagewise.plan.tensor_traffic import LayerTraffic
from stagewise.plan.workload import Workload

GiB = 2**30


def gpt(name: str, batch: int, seq: int) -> Workload:
    config = preset(name)
    loss = (config.loss, config.target(1, seq))
    return workload(config.build(device="meta"), config.example(1, seq), global_batch=batch, tokens_per_sample=seq,
                    loss=loss)  # type: ignore[arg-type]  # fmt: skip


def assert_same_top(work: Workload, cluster: Cluster, tops: tuple[int, ...]) -> Plan:
    """plan(top=k) for each k against the whole search: the same options, figures and order; every rejection it
    lists listed there with the same reason and memory, in the same order; each layout in one of its three lists."""
    full = plan(work, cluster)
    for top in tops:
        pruned = plan(work, cluster, top=top)
        assert pruned.options == full.options[:top], top
        assert [o.simulation for o in pruned.options] == [o.simulation for o in full.options[:top]]
        assert pruned.smallest_memory == full.smallest_memory
        assert len(pruned.options) + len(pruned.rejected) + len(pruned.unranked) == len(full.options + full.rejected)
        reasons = {o.describe(): o for o in full.rejected}
        assert all(reasons[o.describe()] == o for o in pruned.rejected), top  # same reason and rank memory
        order = [o.describe() for o in full.rejected]
        listed = [o.describe() for o in pruned.rejected]
        assert listed == [d for d in order if d in set(listed)], top  # in the candidates' order, as shown
        # What is left out could not be among the top: slower than the top-th, or rejected.
        slower = {o.describe() for o in full.options[top:]}
        assert all(o.describe() in slower or o.describe() in reasons for o in pruned.unranked), top
    return full


@pytest.mark.parametrize(
    ("name", "batch", "seq", "devices", "memory"),
    [
        ("gpt-tiny", 8, 32, 2, 1.0),
        ("gpt-tiny", 16, 64, 4, 1.0),
        ("gpt-tiny-tied", 8, 64, 4, 1.0),
        ("gpt-small", 64, 512, 8, 2.0),  # most layouts overflow the memory
        ("gpt-small", 8, 1024, 2, 0.3),  # none fits: every layout evaluated, each rejection with what it needs
    ],
)
def test_the_top_layouts_are_those_of_the_whole_search(
    name: str, batch: int, seq: int, devices: int, memory: float
) -> None:
    cluster = Cluster((Device(memory * GiB, 1e13),) * devices, gpus_per_node=4)
    full = assert_same_top(gpt(name, batch, seq), cluster, (1, 3, 8))
    if not full.options:
        assert plan(gpt(name, batch, seq), cluster, top=3) == full  # nothing left out: the same plan


def test_mixed_devices_keep_the_same_top() -> None:
    devices = (Device(2 * GiB, 1e13),) * 2 + (Device(1 * GiB, 3e12, memory_bandwidth=5e11),) * 2
    assert_same_top(gpt("gpt-tiny", 16, 128), Cluster(devices, gpus_per_node=2), (1, 4))


def test_ranks_sharing_fewer_cores_keep_the_same_top_and_run_no_slower_for_it() -> None:
    # A CPU job of 4 ranks on 2 cores, profiled with all 4 busy: a rank alone in the bubble runs twice as fast, so
    # the bounds must not assume the costs' speed.
    work = dataclasses.replace(gpt("gpt-tiny", 16, 64), profiled_processes=4)
    plain = Cluster((Device(GiB, 1e13),) * 4, gpus_per_node=4)
    shared = dataclasses.replace(plain, host_cores=2)
    full = assert_same_top(work, shared, (1, 3, 8))
    fixed = {o.describe(): o for o in plan(work, plain).options}
    assert full.options
    for option in full.options:
        alike = fixed[option.describe()]
        assert alike.step_time / 2 <= option.step_time <= alike.step_time * (1 + 1e-9)
    assert any(o.step_time < fixed[o.describe()].step_time * 0.99 for o in full.options if o.pp > 1)


def test_host_cores_describe_one_machine() -> None:
    with pytest.raises(ValueError, match=r"host_cores models one machine's ranks .* 8 devices over nodes of 4"):
        Cluster((Device(GiB, 1e13),) * 8, gpus_per_node=4, host_cores=2)
    with pytest.raises(ValueError, match=r"host_cores"):
        Cluster((Device(GiB, 1e13),) * 2, host_cores=0)


def test_top_must_be_a_count() -> None:
    with pytest.raises(ValueError, match=r"top must be >= 1, got 0; give how many of the fastest layouts to find"):
        plan(gpt("gpt-tiny", 4, 32), Cluster((Device(GiB, 1e13),)), top=0)


@st.composite
def workloads(draw: st.DrawFn) -> tuple[Workload, Cluster]:
    """A random chain of layers (ties, shared activations, pooled gradients, measured times, a tensor-parallel
    plan) and a cluster of up to 4 mixed devices."""
    n = draw(st.integers(2, 7))
    size = st.integers(1, 64)
    costs = []
    for i in range(n):
        flops = draw(st.integers(3, 1000)) * 10**9
        saved = draw(size) * 2**20
        costs.append(
            LayerCost(
                name=f"l{i}", params=(p := draw(size) * 2**18), param_bytes=4 * p,
                buffer_bytes=draw(st.integers(0, 2**20)), flops=flops, forward_flops=flops // 3,
                output_bytes=draw(size) * 2**16, saved_bytes=saved,
                time=draw(st.none() | st.floats(1e-4, 1e-2)), shared_bytes=draw(st.integers(0, 2**20)) if i else 0,
                pooled_bytes=draw(st.integers(0, saved)), use_bytes=draw(st.integers(0, 2**20)),
                working_bytes=draw(st.integers(0, 4 * saved)),
            )
        )  # fmt: skip
    for i in range(1, n):  # a tensor two neighbours save is at most either's
        costs[i] = dataclasses.replace(costs[i], shared_bytes=min(costs[i].shared_bytes, costs[i - 1].saved_bytes))
    tied = draw(st.booleans())
    shared = (
        (SharedParameter(("l0", f"l{n - 1}"), ("w", "w"), (0, n - 1), ("w", "w"), numel=2**16, nbytes=2**18),)
        if tied
        else ()
    )
    if tied:
        for i in (0, n - 1):
            costs[i] = dataclasses.replace(
                costs[i], params=costs[i].params + 2**16, param_bytes=costs[i].param_bytes + 2**18
            )
    traffic = tuple(LayerTraffic(draw(st.booleans()), *(draw(st.integers(0, 2)) for _ in range(3))) for _ in range(n))
    work = Workload(
        costs=tuple(costs), profiled_batch=1, global_batch=draw(st.sampled_from([2, 4, 8, 12])), input_bytes=2**16,
        state_multiplier=draw(st.sampled_from([3.0, 4.0])),
        optimizer_seconds_per_param=draw(st.none() | st.floats(1e-10, 1e-8)),
        loss_seconds=(draw(st.floats(0, 1e-3)), draw(st.floats(0, 1e-3))),
        loss_bytes=draw(st.none() | st.integers(0, 2**26)), shared=shared,
        tensor_parallel=((2, traffic),) if draw(st.booleans()) else (),
    )  # fmt: skip
    kinds = st.builds(
        Device, memory=st.integers(64, 4096).map(lambda mib: mib * 2**20), flops=st.sampled_from([1e12, 3e12]),
        memory_bandwidth=st.sampled_from([1e11, 2e12]),
    )  # fmt: skip
    devices = tuple(draw(st.lists(kinds, min_size=1, max_size=4)))
    return work, Cluster(devices, gpus_per_node=draw(st.sampled_from([1, 2, 4])))


@settings(max_examples=40)
@given(workloads())
def test_the_bounds_never_exceed_what_evaluation_finds(case: tuple[Workload, Cluster]) -> None:
    # Every candidate: a layout that fits can fit, and neither bound of its step time is over the simulated one.
    work, cluster = case
    every = candidates(
        cluster.n_devices, len(work.costs), work.global_batch, tp_degrees=tensor_parallel_degrees(work),
        gpus_per_node=cluster.gpus_per_node,
    )  # fmt: skip
    made = Settings(work, cluster)
    for option in every:
        exact = evaluate(option, work, cluster)
        setting = made.of(option)
        if isinstance(setting, Rejection):
            assert exact.rejected == setting.reason
            continue
        if exact.rejected is not None:
            continue
        assert can_fit(setting), option.describe()
        assert step_floor(setting, work, cluster) <= exact.step_time, option.describe()
        part = partitioned(setting)
        assert not isinstance(part, Rejection) and exact.simulation is not None
        assert pipeline_floor(setting, timed(setting, part, cluster)) <= exact.simulation.step_time
        assert overheads(setting, part, work, cluster).step(exact.simulation.step_time) == exact.step_time
    full = plan(work, cluster, options=every)
    pruned = plan(work, cluster, options=every, top=2)
    assert pruned.options == full.options[:2] and pruned.smallest_memory == full.smallest_memory
