"""LayerCost: what one layer costs for one micro-batch, as :func:`~stagewise.partition.profile` measures it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LayerCost:
    """What one layer costs, for one micro-batch of the profiled sample."""

    name: str
    """The layer's path in the model."""
    params: int
    """Number of parameter elements."""
    param_bytes: int
    """Bytes of the parameters."""
    buffer_bytes: int
    """Bytes of the buffers (running statistics and the like)."""
    flops: int
    """Forward plus backward floating-point operations (``torch.utils.flop_counter``)."""
    forward_flops: int
    """Forward floating-point operations alone."""
    output_bytes: int
    """Bytes of the layer's output: what crosses a stage boundary placed after it."""
    saved_bytes: int
    """Bytes saved for backward, excluding parameters: what the layer alone holds per micro-batch in flight.

    Attention counts as the fused kernel (output and log-sum-exp saved), on meta too. A tensor that two
    consecutive layers both save (a ReLU's output, which the next linear saves as its input) counts in
    each layer's; :attr:`shared_bytes` says how much, so that a stage counts it once."""
    time: float | None
    """Median forward plus backward seconds, when measured; None otherwise."""
    shared_bytes: int = 0
    """Bytes of :attr:`saved_bytes` that the layer before saves too: the layer's input, where both keep it.

    A stage of layers ``a .. b`` holds ``sum(saved_bytes) - sum(shared_bytes of a + 1 .. b)`` per micro-batch
    (its first layer's input comes from another stage, so nothing before it shares it)."""
    pooled_bytes: int = 0
    """Bytes a pooled weight gradient keeps for one micro-batch until its pool is flushed.

    The input and the output gradient of each linear whose weight has at least
    :data:`~stagewise.partition.linears.DEFAULT_MIN_POOLED_ELEMENTS` elements (what ``Pipeline``'s default
    fusion pools; see ``stagewise.pipeline.WeightGradientFusion``)."""
    use_bytes: int = 0
    """Bytes of the outputs of the ops that read a parameter, pooled linears aside: zero-bubble's input pass
    (I) keeps their gradients, one micro-batch's this much, for its weight pass (W)."""
    pooled_input_bytes: int = 0
    """Bytes of :attr:`pooled_bytes` that are the pooled linears' inputs, which each linear also saves for its
    backward (in :attr:`saved_bytes`): zero-bubble's input pass keeps the graph for W, so they are held once."""
    working_bytes: int = 0
    """Bytes the layer holds for a moment beyond what it saves while it computes one micro-batch: the gradient
    of its output and of its input and the temporaries of its backward (its parameters' gradients aside), or
    of its forward where those are more (:class:`~stagewise.partition.LiveBytes`, on meta too)."""
    selective_bytes: int = 0
    """Bytes of the outputs of the ops that selective activation checkpointing keeps
    (:data:`~stagewise.partition.selective.KEPT_OPS`: matmuls and fused attention), each storage once: what a
    layer saves under it beside its input (:class:`~stagewise.partition.selective.SelectiveCount`)."""
    recompute_flops: int = 0
    """Forward FLOPs of the ops selective checkpointing recomputes (every op it does not keep; about 0 for a
    transformer layer, whose FLOPs are in its matmuls and attention)."""
    recompute_bytes: int = 0
    """Bytes the ops selective checkpointing recomputes read and write (norms, activations, additions, rope,
    eager softmax): what their recomputation costs at the device's memory bandwidth."""
    flush_bytes: int = 0
    """Bytes of the two largest pooled linears of the layer (input and output bytes each): what flushing a
    weight-gradient pool of ``k`` backwards concatenates at once, ``k`` times this at most (it concatenates one
    weight's pooled tensors after another's, the one before still alive)."""
    recompute_time: float | None = None
    """Seconds the ops selective checkpointing recomputes took in one forward, timed one by one
    (:class:`~stagewise.partition.selective.RecomputeClock`), where times are measured; None: priced by
    :attr:`recompute_flops` and :attr:`recompute_bytes`."""
    checkpoint_flops: int | None = None
    """Forward FLOPs that whole-layer activation checkpointing recomputes: those of the ops before the forward's
    last saved tensor. torch stops recomputing once the backward has every tensor the forward saved, so a layer's
    trailing ops (a GPT block's last matmul, a third of its FLOPs) do not run again. None: the whole forward."""
