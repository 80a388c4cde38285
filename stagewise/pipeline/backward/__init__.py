"""The backward: its plan per forward, fused and split weight gradients, the gradients sent between stages, clipping."""
