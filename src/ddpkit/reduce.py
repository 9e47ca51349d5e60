"""Exact metrics across ranks: add sums and counts with one all_reduce.

Each rank computes sums over its own samples (loss sum, correct predictions,
sample count); :func:`reduce_sums` adds them over the ranks, so a mean
computed from the result is the same as on one process, whatever the number
of workers: no averaging of averages, no padded duplicates. With
``ddpkit.DataLoader(dataset, global_batch_size=..., shuffle=False)`` every sample
of an evaluation set is seen by exactly one rank::

    sums = {"loss": 0.0, "correct": 0, "count": 0}
    for x, y in test_loader:
        out = model(x)
        sums["loss"] += F.cross_entropy(out, y, reduction="sum")
        sums["correct"] += (out.argmax(1) == y).sum()
        sums["count"] += len(y)
    total = ddpkit.reduce_sums(sums)
    accuracy = total["correct"] / total["count"]

Tensors of any shape add up element by element (a confusion matrix
``torch.zeros(10, 10)`` comes back summed, as a tensor of that shape).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from ddpkit.distributed import control_device


def reduce_sums(values: Mapping[str, float | torch.Tensor], group: dist.ProcessGroup | None = None) -> dict[str, Any]:
    """Add ``values`` up over the ranks of ``group`` (float64, one all_reduce for all of them).

    Values may be numbers, zero-dimensional tensors, or tensors of any shape (a
    confusion matrix, per-class counts) on any device. A number or a
    zero-dimensional tensor comes back as a float; a tensor with dimensions
    comes back as a tensor of its shape, dtype and device. The collective runs
    on the device the group's backend takes (CPU for gloo, this rank's GPU for
    nccl), also with a single worker, so that path is the same at every world size.
    Without a process group the values are returned as they are (tensors copied).
    """
    names = list(values)
    if not names:
        return {}
    device = control_device(group)
    parts = [torch.as_tensor(values[n]) for n in names]
    packed = torch.cat([p.detach().to(device=device, dtype=torch.float64).reshape(-1) for p in parts])
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(packed, group=group)
    totals = packed.cpu().split([p.numel() for p in parts])
    return {n: _like(total, part) for n, total, part in zip(names, totals, parts)}


def _like(total: torch.Tensor, part: torch.Tensor) -> float | torch.Tensor:
    """``total`` as a float for a scalar ``part``, else as a tensor of ``part``'s shape, dtype and device."""
    if part.dim() == 0:
        return total.item()
    return total.reshape(part.shape).to(dtype=part.dtype, device=part.device)
