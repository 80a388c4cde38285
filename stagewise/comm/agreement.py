"""everyone_agrees(): whether a condition holds on every rank, so all ranks raise together and none hangs."""

from __future__ import annotations

import torch
import torch.distributed as dist


def everyone_agrees(ok: bool, device: torch.device) -> bool:
    """Whether ``ok`` holds on every rank; a collective, so all ranks raise together rather than some hang."""
    if not dist.is_initialized():
        return ok
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())
