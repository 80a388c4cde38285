"""The moments a rank's memory is counted at, on small made-up costs: a weight-gradient pool's flush, the
optimizer's step after the activations are gone, and the loss under selective checkpointing of a last layer whose
output it keeps."""

from __future__ import annotations

import dataclasses

import pytest

from stagewise.partition import LayerCost
from stagewise.plan import Option, evaluate
from stagewise.plan.cluster import Cluster, Device
from stagewise.plan.rank_memory import optimizer_bytes
from stagewise.plan.setting import loss_beyond
from stagewise.plan.workload import Workload

GiB = 2**30
MiB = 2**20


def layer(i: int, *, param_gib: float = 1.0, **extra: int) -> LayerCost:
    """One layer: ``param_gib`` GiB of parameters, 1 s forward and 2 s backward at 1e12 FLOP/s, saving 1 GiB."""
    fields: dict[str, int] = {"output_bytes": MiB, "saved_bytes": GiB} | extra
    return LayerCost(
        name=f"l{i}", params=int(param_gib * GiB) // 4, param_bytes=int(param_gib * GiB), buffer_bytes=0,
        flops=3 * 10**12, forward_flops=10**12, time=None, **fields,
    )  # fmt: skip


def cluster(n: int) -> Cluster:
    return Cluster((Device(1024 * GiB, 1e12),) * n)


def test_flushing_a_pool_of_k_backwards_holds_k_times_the_two_largest_pooled_linears_on_top() -> None:
    def rank_activation(flush: int, ckpt: bool = False, saved: int = GiB // 4) -> tuple[float, ...]:
        costs = tuple(layer(i, saved_bytes=saved, pooled_bytes=GiB // 2, flush_bytes=flush) for i in range(4))
        work = Workload(costs=costs, profiled_batch=1, global_batch=4, input_bytes=MiB)
        found = evaluate(Option(2, 1, 1, 4, "1f1b", ckpt), work, cluster(2))
        assert found.partition is not None and found.partition.bounds == (0, 2, 4)
        return found.rank_activation

    without, flushed = rank_activation(0), rank_activation(3 * GiB // 8)
    # 1F1B over 2 ranks: rank 0 pools 1 backward (nothing concatenated), rank 1 pools 2: its flush holds twice
    # its layers' most (0.375 GiB) on top of its full pool (2 GiB, no micro-batch in flight then), its fullest
    # moment (0.5 GiB in flight and 1 GiB pooled is less).
    assert flushed[0] == pytest.approx(without[0])
    assert flushed[1] - without[1] == pytest.approx(2 * 3 * GiB / 8)
    # Saving 1 GiB a layer, rank 1 is fullest with a micro-batch in flight (2 GiB) and one pooled (1 GiB): its
    # flush, with none in flight, holds less.
    assert rank_activation(3 * GiB // 8, saved=GiB) == pytest.approx(rank_activation(0, saved=GiB))
    # Whole-layer checkpointing pools nothing.
    assert rank_activation(3 * GiB // 8, ckpt=True) == pytest.approx(rank_activation(0, ckpt=True))


def test_a_rank_with_small_activations_is_fullest_while_adamw_steps() -> None:
    costs = (layer(0, param_gib=3.0), *(layer(i) for i in range(1, 4)))
    adamw = Workload(costs=costs, profiled_batch=1, global_batch=4, input_bytes=MiB)
    option = Option(2, 1, 1, 4, "1f1b", True)
    found = evaluate(option, adamw, cluster(2))
    assert found.partition is not None and found.partition.bounds == (0, 2, 4)
    # Checkpointed: the layers' inputs and one layer recomputed (1 GiB), less than the step's temporaries. Rank 0
    # holds 4 GiB of parameters (3 of them in one layer), rank 1 2 GiB: four copies each (weights, gradients, two
    # moments), and the step's temporaries: the larger of one copy of every parameter (foreach) and two of the
    # largest (per tensor): 6 GiB and 2 GiB.
    assert max(found.rank_activation) < 1.01 * GiB
    assert found.rank_memory == pytest.approx((4 * 4 * GiB + 6 * GiB, 4 * 2 * GiB + 2 * GiB))
    # SGD with momentum (2 copies) steps in place: the activations' moment is the fullest.
    sgd = evaluate(option, dataclasses.replace(adamw, state_multiplier=2.0), cluster(2))
    assert [m - a for m, a in zip(sgd.rank_memory, sgd.rank_activation, strict=True)] == pytest.approx(
        [2 * 4 * GiB, 2 * 2 * GiB]
    )
    assert optimizer_bytes(4 * GiB, 3 * GiB, 4.0) == 6 * GiB
    assert optimizer_bytes(4 * GiB, 1 * GiB, 4.0) == 4 * GiB
    assert optimizer_bytes(4 * GiB, 3 * GiB, 2.0) == 0.0


def test_selective_checkpointing_counts_the_head_output_the_loss_reads_once() -> None:
    # The last layer, a head of one matmul: 64 MiB of logits, which selective checkpointing keeps; the loss holds
    # them with their log-softmax and the gradients of both (4 x 64 MiB).
    head = layer(3, output_bytes=64 * MiB, saved_bytes=MiB, selective_bytes=64 * MiB)
    # The logits are held by the pipeline until the backward (or kept by selective checkpointing, the same
    # storage) and the log-softmax counts as saved: the loss holds the two gradients beyond them.
    assert loss_beyond(256 * MiB, 1.0, head, False) == 128 * MiB
    assert loss_beyond(256 * MiB, 1.0, head, True) == 128 * MiB
    assert loss_beyond(256 * MiB, 1.0, head, "selective") == 128 * MiB
    assert loss_beyond(None, 1.0, head, "selective") == 0.0
    costs = (*(layer(i, selective_bytes=GiB // 2) for i in range(3)), head)
    work = Workload(costs=costs, profiled_batch=1, global_batch=1, input_bytes=MiB, loss_bytes=256 * MiB)
    found = evaluate(Option(1, 1, 1, 1, "1f1b", "selective"), work, cluster(1))
    # Kept: each layer's input and what selective keeps (the head's logits), the loss's log-softmax; on top the
    # largest layer recomputed (0.5 GiB) and the loss's gradients (2 x 64 MiB), its logits already counted.
    kept = MiB + 3 * (GiB / 2 + MiB) + 64 * MiB + 64 * MiB
    assert found.rank_activation[0] == pytest.approx(kept + GiB / 2 + 128 * MiB, rel=1e-6)


def test_zero_bubble_holds_the_output_gradients_for_w_and_each_micro_batchs_logits_until_it() -> None:
    # Two layers of 1 GiB saved, each with a pooled linear whose input (0.25 GiB) it saves and whose output
    # gradient (0.25 GiB) I keeps for W, and 0.125 GiB of other outputs whose gradients I keeps; the last one a
    # head with 64 MiB of logits, the loss holding 4 x 64 MiB at its fullest.
    extra = {"pooled_bytes": GiB // 2, "pooled_input_bytes": GiB // 4, "use_bytes": GiB // 8}
    costs = (layer(0, **extra), layer(1, output_bytes=64 * MiB, **extra))
    work = Workload(costs=costs, profiled_batch=1, global_batch=4, input_bytes=MiB, loss_bytes=256 * MiB)
    found = evaluate(Option(2, 1, 1, 4, "zero-bubble", False), work, cluster(2))
    assert found.partition is not None and found.partition.bounds == (0, 1, 2)
    # Rank 1 (F0 I0 F1 I1 W0 ...) at its fullest after I1: two micro-batches in flight (1 GiB saved, the loss's
    # log-softmax and the logits the pipeline holds until W) and waiting for W (0.375 GiB: the linear's input is
    # in the graph I keeps already); on top the loss's gradient of the log-softmax (that of the logits is the
    # head's output gradient, waiting for W).
    in_flight = GiB + 64 * MiB + 64 * MiB
    assert found.rank_activation[1] == pytest.approx(2 * in_flight + 2 * (GiB / 4 + GiB / 8) + 64 * MiB, rel=1e-6)
    # Checkpointed layers save no linear inputs: I keeps its recomputed ones for W. One layer recomputed on top.
    whole = evaluate(Option(2, 1, 1, 4, "zero-bubble", True), work, cluster(2))
    assert whole.partition is not None and whole.partition.bounds == (0, 1, 2)
    kept = MiB + 64 * MiB + 64 * MiB  # the layer's input, the loss's tensor and the logits
    assert whole.rank_activation[1] == pytest.approx(2 * kept + 2 * (GiB / 2 + GiB / 8) + GiB + 64 * MiB, rel=1e-6)
