"""Pipeline training equals the unsplit model, for drawn chains, partitions, schedules and micro-batch counts."""

from __future__ import annotations

import os
from dataclasses import replace

import torch
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.cases import Case
from support.chains import KINDS, Chain, mse, reference
from support.multiproc import run_ranks

from stagewise.comm import init_mesh
from stagewise.partition import Partition
from stagewise.pipeline import Pipeline, PipelineOptions, WeightGradientFusion
from stagewise.schedule import Schedule, StageCosts, synthesise

STEPS = 3


def train_cases(cases: list[Case], n_ranks: int) -> list[dict[str, object]]:
    torch.set_num_threads(1)
    mesh = init_mesh(n_ranks, timeout=20)
    results = []
    for case in cases:
        os.environ["STAGEWISE_SHARED_MEMORY"] = "0" if case.over_gloo else "1"  # read when the Pipeline is built
        model = case.chain.build()
        pipe = Pipeline(
            model,
            Partition.from_bounds(case.bounds),
            schedule=case.schedule,  # type: ignore[arg-type]
            n_microbatches=case.n_microbatches,
            loss_fn=mse,
            mesh=mesh,
            options=PipelineOptions(n_virtual=case.n_virtual, fuse_weight_gradients=case.fusion),
        )
        params = list(pipe.parameters())
        opt = torch.optim.SGD(params, lr=0.05) if params else None  # a stage may hold only GELUs
        losses, first_grads = [], {}
        for step in range(STEPS):
            x, y = case.chain.batch(case.global_batch, step)
            if opt is not None:
                opt.zero_grad()
            losses.append(pipe.step(x, y).item())
            if step == 0:
                first_grads = {n: p.grad.clone() for n, p in pipe.named_parameters() if p.grad is not None}
            if opt is not None:
                opt.step()
        final = {n: p.detach().clone() for n, p in pipe.named_parameters()}
        results.append({"losses": losses, "grads": first_grads, "params": final})
    dist.destroy_process_group()
    return results


ROUND_ROBIN = ("gpipe", "1f1b", "interleaved-1f1b", "zero-bubble")
LOOPED_AND_V = ("looped-bfs", "zbv", "dualpipev")
"""Several stages per rank; the V places stages r and 2p - 1 - r on rank r (DualPipeV: m >= 2p)."""


@st.composite
def cases(draw: st.DrawFn, n_ranks: int, schedules: tuple[str, ...] = ROUND_ROBIN) -> Case:
    schedule = draw(st.sampled_from(schedules))
    v = 2 if schedule in ("interleaved-1f1b", *LOOPED_AND_V) else 1
    n_stages = n_ranks * v
    with_ids = draw(st.booleans())
    extra = 2 if with_ids else 0
    kinds = tuple(draw(st.lists(st.sampled_from(KINDS), min_size=max(n_stages - extra, 2), max_size=n_stages + 4)))
    chain = Chain(kinds, width=8, with_ids=with_ids, seed=draw(st.integers(0, 1000)))
    n = chain.n_layers
    cuts = sorted(draw(st.lists(st.integers(1, n - 1), min_size=n_stages - 1, max_size=n_stages - 1, unique=True)))
    m = draw(st.integers(2 * n_ranks if schedule == "dualpipev" else 1, 8))
    if schedule == "interleaved-1f1b":
        m = n_ranks * draw(st.integers(1, max(1, 8 // n_ranks)))
    batch = draw(st.integers(m, 3 * m + 2))
    if batch % m == 0 and batch > m:
        batch += 1  # sizes not divisible by m, where possible
    fusion = draw(st.sampled_from([None, None, 1, 2, 3, "free"]).map(WeightGradientFusion.every))
    either = draw(st.sampled_from([WeightGradientFusion.off(), fusion]))
    return Case(chain, (0, *cuts, n), schedule, v, m, batch, fusion=either)


def check(case_list: list[Case], n_ranks: int) -> None:
    per_rank = run_ranks(train_cases, n_ranks, case_list, n_ranks, timeout=240)
    for i, case in enumerate(case_list):
        want = reference(case.chain, case.global_batch, STEPS)
        got_grads: dict[str, torch.Tensor] = {}
        got_params: dict[str, torch.Tensor] = {}
        for rank in range(n_ranks):
            result = per_rank[rank][i]
            assert result["losses"] == per_rank[0][i]["losses"], "every rank returns the same loss"
            got_grads.update(result["grads"])
            got_params.update(result["params"])
        torch.testing.assert_close(
            torch.tensor(per_rank[0][i]["losses"]), torch.tensor(want["losses"]), atol=1e-5, rtol=1e-5, msg=str(case)
        )
        assert got_grads.keys() == want["grads"].keys(), case  # type: ignore[attr-defined]
        for name, grad in want["grads"].items():  # type: ignore[attr-defined]
            torch.testing.assert_close(got_grads[name], grad, atol=1e-5, rtol=1e-5, msg=f"{name} in {case}")
        for name, param in want["params"].items():  # type: ignore[attr-defined]
            torch.testing.assert_close(got_params[name], param, atol=1e-5, rtol=1e-5, msg=f"{name} in {case}")


@settings(max_examples=2, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(st.lists(cases(2), min_size=12, max_size=12))
def test_two_ranks_equal_the_unsplit_model(case_list: list[Case]) -> None:
    check(case_list, 2)


@settings(max_examples=2, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(st.lists(cases(3), min_size=12, max_size=12))
def test_three_ranks_equal_the_unsplit_model(case_list: list[Case]) -> None:
    check(case_list, 3)


@settings(max_examples=1, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(st.lists(cases(2, LOOPED_AND_V), min_size=10, max_size=10))
def test_v_shaped_and_looped_schedules_on_two_ranks_equal_the_unsplit_model(case_list: list[Case]) -> None:
    check(case_list, 2)


@settings(max_examples=1, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(st.lists(cases(3, LOOPED_AND_V), min_size=10, max_size=10))
def test_v_shaped_and_looped_schedules_on_three_ranks_equal_the_unsplit_model(case_list: list[Case]) -> None:
    check(case_list, 3)


def synthesised(n_ranks: int, n_virtual: int, m: int, *, limit: int) -> Schedule:
    """A schedule built for unequal stages: a light first, a heavy last, a split backward."""
    n = n_ranks * n_virtual
    forward = [1.0] * n
    forward[0], forward[-1] = 0.5, 2.0
    costs = StageCosts.of(n, forward=forward, input_grad=forward, weight_grad=[0.7 * f for f in forward])
    return synthesise(costs, n_ranks, m, limit=limit).schedule


def test_every_schedule_on_a_fixed_case() -> None:
    chain = Chain(("linear", "gelu", "residual", "norm", "linear", "residual"), with_ids=True, seed=3)
    fixed = [
        Case(chain, (0, 2, 5, 8), "gpipe", 1, 5, 13),
        Case(chain, (0, 5, 6, 8), "gpipe", 1, 4, 9),  # a lone linear: what its deferred W reads was received
        Case(chain, (0, 3, 4, 8), "1f1b", 1, 4, 11),
        Case(chain, (0, 3, 4, 8), "1f1b", 1, 4, 11, fusion=WeightGradientFusion.off()),
        Case(chain, (0, 5, 6, 8), "1f1b", 1, 5, 12, fusion=WeightGradientFusion.every(pool=2)),
        Case(chain, (0, 2, 5, 8), "1f1b", 1, 6, 13, fusion=WeightGradientFusion.every(pool="free")),  # pools 1, 2, 3
        Case(chain, (0, 1, 2, 3, 5, 6, 8), "interleaved-1f1b", 2, 6, 14, fusion=WeightGradientFusion.every("free")),
        Case(chain, (0, 1, 6, 8), "zero-bubble", 1, 7, 9),
        Case(chain, (0, 1, 2, 3, 5, 6, 8), "interleaved-1f1b", 2, 6, 14),
        Case(chain, (0, 4, 6, 8), "zero-bubble", 1, 1, 3),
        Case(chain, (0, 1, 2, 3, 5, 6, 8), "zbv", 2, 5, 11),  # rank 0 holds the first and the last stage
        Case(chain, (0, 1, 2, 4, 5, 7, 8), "looped-bfs", 2, 3, 7),
        Case(chain, (0, 2, 3, 4, 5, 6, 8), "dualpipev", 2, 7, 16),  # B and I/W mixed, uneven micro-batches
        Case(chain, (0, 3, 4, 8), synthesised(3, 1, 5, limit=2), 1, 5, 11),  # built for unequal stages
        Case(chain, (0, 1, 2, 3, 5, 6, 8), synthesised(3, 2, 6, limit=3), 2, 6, 13),
    ]
    # Ranks on other hosts exchange through the transport's own gloo group, not shared memory: the same results.
    check(fixed + [replace(fixed[i], over_gloo=True) for i in (2, 6, 7, 10)], 3)
