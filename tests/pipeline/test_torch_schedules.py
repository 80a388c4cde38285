"""Schedules both ways between stagewise and torch.distributed.pipelining: torch's classes imported, stagewise's
exported, each checked by the other side's validator, and torch's V-shaped schedules trained by stagewise."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed.pipelining.schedules as torch_schedules
import torch.nn.functional as F
from support.cases import Case
from support.chains import Chain, reference
from support.multiproc import run_ranks
from test_pipeline_equivalence import STEPS, train_cases
from torch import nn

from stagewise.comm import init_mesh
from stagewise.partition import Partition
from stagewise.pipeline import Pipeline, torch_runtime, torch_stages
from stagewise.pipeline.interop.torch_schedules import from_actions, from_torch, to_torch
from stagewise.schedule import Schedule, StageCosts, build, simulate, validate
from stagewise.schedule.builders import BUILDERS

BOUNDS = (0, 2, 3, 5, 8)
"""Four stages of the chain below, the third a lone GELU: rank 0 holds stages 0 and 3, rank 1 stages 1 and 2."""

MULTI = [
    torch_schedules.ScheduleInterleaved1F1B,
    torch_schedules.ScheduleLoopedBFS,
    torch_schedules.ScheduleInterleavedZeroBubble,
    torch_schedules.ScheduleZBVZeroBubble,
    torch_schedules.ScheduleDualPipeV,
]
V_SHAPED = (torch_schedules.ScheduleZBVZeroBubble, torch_schedules.ScheduleDualPipeV)
ROUNDS = (torch_schedules.ScheduleInterleaved1F1B, torch_schedules.ScheduleInterleavedZeroBubble)
"""torch's schedules that take a multiple of the ranks of micro-batches."""


@pytest.mark.parametrize("schedule_class", MULTI, ids=lambda c: c.__name__)
@pytest.mark.parametrize(("p", "m"), [(2, 4), (2, 7), (3, 6), (4, 8), (4, 16)])
def test_torchs_schedules_import_and_validate(schedule_class: type, p: int, m: int) -> None:
    if schedule_class in ROUNDS and m % p:  # torch's own refusal comes through as it is
        with pytest.raises(ValueError, match=r"multiple of"):
            from_torch(schedule_class, p, m, n_stages=2 * p)
        return
    schedule = from_torch(schedule_class, p, m, n_stages=2 * p)
    validate(schedule)
    assert schedule.n_ranks == p and schedule.n_microbatches == m
    v = (*range(p), *reversed(range(p)))
    assert schedule.placement == (v if schedule_class in V_SHAPED else tuple(s % p for s in range(2 * p)))


@pytest.mark.parametrize("name", list(BUILDERS))
@pytest.mark.parametrize(("p", "m"), [(1, 3), (2, 4), (3, 5), (4, 8)])
def test_every_builtin_exports_to_actions_torch_validates_and_reads_back(name: str, p: int, m: int) -> None:
    v = 2 if BUILDERS[name].virtual else 1  # type: ignore[index]
    if BUILDERS[name].whole_rounds and m % p:  # type: ignore[index]
        m = p * 2
    m = max(m, BUILDERS[name].least_rounds * p)  # type: ignore[index]
    schedule = build(name, p * v, m, n_virtual=v)  # type: ignore[arg-type]
    actions = to_torch(schedule)
    torch_schedules._validate_schedule(actions, p, p * v, m)
    again = from_actions(actions, m, name=schedule.name)
    assert again.ranks == schedule.ranks and again.placement == schedule.placement


V_SHAPED_BUILTINS = {"zbv": torch_schedules.ScheduleZBVZeroBubble, "dualpipev": torch_schedules.ScheduleDualPipeV}
"""stagewise's V-shaped schedules and torch's same-named ones."""


@pytest.mark.parametrize("name", list(V_SHAPED_BUILTINS))
@pytest.mark.parametrize("p", [1, 2, 3, 4, 8])
def test_the_v_shaped_builtins_are_torchs_action_for_action(name: str, p: int) -> None:
    least = BUILDERS[name].least_rounds * p  # type: ignore[index]
    for m in sorted({max(m, least) for m in (1, p + 1, 2 * p, 2 * p + 3, 32)}):
        ours = build(name, 2 * p, m, n_virtual=2)  # type: ignore[arg-type]
        theirs = from_torch(V_SHAPED_BUILTINS[name], p, m, n_stages=2 * p)  # DualPipeV's overlapped pair: F, then B
        assert ours.ranks == theirs.ranks and ours.placement == theirs.placement, m


@pytest.mark.parametrize("name", list(V_SHAPED_BUILTINS))
def test_the_v_shaped_builtins_against_torchs_at_four_ranks_and_eight_micro_batches(name: str) -> None:
    costs = StageCosts.of(8, forward=1.0, input_grad=1.0, weight_grad=1.0)
    ours = simulate(build(name, 8, 8, n_virtual=2), costs)  # type: ignore[arg-type]
    theirs = simulate(from_torch(V_SHAPED_BUILTINS[name], 4, 8, n_stages=8), costs)
    assert round(ours.bubble, 6) == round(theirs.bubble, 6) == round(1 / 17, 6)
    # Rank 0 holds stages 0 and 7: micro-batches in flight there, in half-size stages.
    assert ours.peak_in_flight[0] + ours.peak_in_flight[7] == theirs.peak_in_flight[0] + theirs.peak_in_flight[7] == 9


def test_v_shaped_schedules_under_torchs_own_simulator() -> None:
    # torch's simulator steps through the exported actions with their sends and receives, one step each.
    p, n = 4, 8

    def v(stage: int) -> int:
        return stage if stage < p else 2 * p - 1 - stage

    def steps(schedule: Schedule) -> int:
        actions = torch_schedules._add_send_recv(to_torch(schedule), stage_to_rank=v, num_stages=n)
        return max(len(a) for a in torch_schedules._simulate_comms_compute(actions, v, n).values())

    for name, cls in V_SHAPED_BUILTINS.items():
        ours = steps(build(name, n, 8, n_virtual=2))  # type: ignore[arg-type]
        assert ours == steps(from_torch(cls, p, 8, n_stages=n)) == {"zbv": 133, "dualpipev": 125}[name]


def test_a_class_that_is_not_a_multi_stage_schedule_is_refused() -> None:
    with pytest.raises(TypeError, match=r"from_torch takes one of torch's multi-stage schedule classes"):
        from_torch(torch_schedules.Schedule1F1B, 2, 4, n_stages=2)
    with pytest.raises(ValueError, match=r"5 stages do not spread evenly over 2 ranks; give a multiple of 2"):
        from_torch(torch_schedules.ScheduleZBVZeroBubble, 2, 4, n_stages=5)


def test_torchs_v_shaped_schedules_train_as_the_unsplit_model_under_stagewise() -> None:
    chain = Chain(("linear", "gelu", "residual", "norm", "linear", "residual"), with_ids=True, seed=5)
    cases = [
        Case(chain, (0, 2, 3, 5, 8), from_torch(torch_schedules.ScheduleDualPipeV, 2, 4, n_stages=4), 2, 4, 9),
        Case(chain, (0, 1, 4, 6, 8), from_torch(torch_schedules.ScheduleZBVZeroBubble, 2, 5, n_stages=4), 2, 5, 13),
        Case(chain, (0, 1, 2, 3, 5, 6, 8), from_torch(torch_schedules.ScheduleDualPipeV, 3, 6, n_stages=6), 2, 6, 14),
    ]
    two = run_ranks(train_cases, 2, cases[:2], 2, timeout=240)
    three = run_ranks(train_cases, 3, cases[2:], 3, timeout=240)
    for case, per_rank in [(cases[0], {r: two[r][0] for r in two}), (cases[1], {r: two[r][1] for r in two}),
                           (cases[2], {r: three[r][0] for r in three})]:  # fmt: skip
        want = reference(case.chain, case.global_batch, STEPS)
        got = {name: g for result in per_rank.values() for name, g in result["grads"].items()}
        torch.testing.assert_close(
            torch.tensor(per_rank[0]["losses"]), torch.tensor(want["losses"]), atol=1e-5, rtol=1e-5
        )
        assert got.keys() == want["grads"].keys()  # type: ignore[attr-defined]
        for name, grad in want["grads"].items():  # type: ignore[attr-defined]
            torch.testing.assert_close(got[name], grad, atol=1e-5, rtol=1e-5, msg=name)


def chain() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8), nn.Tanh(),
                         nn.Linear(8, 8), nn.GELU())  # fmt: skip


def batch(m: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(2 * m, 8, generator=g), torch.randn(2 * m, 8, generator=g)


def zbv_under_both_runtimes(m: int) -> dict[str, object]:
    """One step of stagewise's ZBV on this rank: under torch's runtime (exported), then under stagewise's executor."""
    torch.set_num_threads(1)
    mesh = init_mesh(2, timeout=30)
    rank, schedule, (x, y) = dist.get_rank(), build("zbv", 4, m, n_virtual=2), batch(m)
    model = chain()
    stages = torch_stages(model, Partition.from_bounds(BOUNDS), schedule, rank, group=mesh.pp_group)
    runtime = torch_runtime(stages, schedule, F.mse_loss)
    losses: list[torch.Tensor] = []
    if rank == 0:  # the V's rank 0 holds the first stage and the last
        runtime.step(x, target=y, losses=losses)
    else:
        runtime.step()
    under_torch = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    pipe = Pipeline(chain(), Partition.from_bounds(BOUNDS), schedule=schedule, n_microbatches=m, loss_fn=F.mse_loss,
                    mesh=mesh)  # fmt: skip
    loss = pipe.step(x, y).item()
    under_stagewise = {name: p.grad.clone() for name, p in pipe.named_parameters() if p.grad is not None}
    pipe.close()
    dist.destroy_process_group()
    losses_under_torch = [t.item() for t in losses]
    return {"torch_losses": losses_under_torch, "torch": under_torch, "loss": loss, "stagewise": under_stagewise}


def test_stagewise_zbv_exported_runs_under_torchs_runtime_as_under_stagewise() -> None:
    m = 4
    ranks = run_ranks(zbv_under_both_runtimes, 2, m, timeout=120)
    model, (x, y) = chain(), batch(m)
    per_microbatch = [F.mse_loss(model(x[2 * i : 2 * i + 2]), y[2 * i : 2 * i + 2]) for i in range(m)]
    (sum(per_microbatch) / m).backward()  # torch's runtime scales each micro-batch's gradient by 1/m
    want = {name: p.grad for name, p in model.named_parameters()}
    assert ranks[0]["torch_losses"] == pytest.approx([t.item() for t in per_microbatch], abs=1e-6)
    assert ranks[0]["loss"] == ranks[1]["loss"] == pytest.approx(sum(t.item() for t in per_microbatch) / m, abs=1e-6)
    for runtime in ("torch", "stagewise"):
        got = {name: g for r in ranks.values() for name, g in r[runtime].items()}  # type: ignore[attr-defined]
        assert got.keys() == want.keys(), runtime
        for name, grad in want.items():
            torch.testing.assert_close(got[name], grad, atol=1e-6, rtol=1e-5, msg=f"{name} under {runtime}")
