"""Functions for ddpkit.launch's tests that a fresh process can import by name (start_method forkserver)."""

from __future__ import annotations

import torch
import torch.distributed as dist

import ddpkit


def rank_sum(tag: str) -> tuple[int, str, float]:
    """All-reduce rank + 1 over the job; return (rank, tag, the sum)."""
    ctx = ddpkit.init()
    total = torch.tensor([float(ctx.rank + 1)])
    dist.all_reduce(total)
    print(f"rank {ctx.rank} of {ctx.world_size}: sum {total.item()}")
    return ctx.rank, tag, total.item()
