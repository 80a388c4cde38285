"""The linear ops whose weight gradients a pipeline fuses and pools, and the weight size from which it pools them."""

# Both the profiler (what a pooled weight gradient keeps, per layer) and the runtime
# (stagewise.pipeline.backward.fusion) read these, so that the bytes the partitioner counts are the bytes the pipeline
# holds.

from __future__ import annotations

import torch
import torch.nn.functional as F

LINEAR_OPS: frozenset[object] = frozenset({F.linear, torch.ops.aten.linear.default})
"""The linear ops whose weight gradients ``Pipeline`` fuses and pools: ``F.linear`` (what ``nn.Linear`` calls) and
the ATen op that captured graphs call."""

DEFAULT_MIN_POOLED_ELEMENTS = 1 << 18
"""Weights smaller than this are left to autograd when backwards pool their weight gradients.

A pooled weight gradient is one GEMM over several micro-batches, which pays
off for smaller weights than the per-micro-batch fused GEMM does. Measured like
``stagewise.pipeline.config.DEFAULT_MIN_ELEMENTS``, pooling all 8 micro-batches:
0.77-0.82x autograd's step time with 262k-element weights (d = 256), but
1.14-1.20x with 4k- to 65k-element ones (d = 32 to 128).
"""
