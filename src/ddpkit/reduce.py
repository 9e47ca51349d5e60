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
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist

from ddpkit.distributed import control_device


def reduce_sums(values: Mapping[str, float | torch.Tensor], group: dist.ProcessGroup | None = None) -> dict[str, float]:
    """Add ``values`` up over the ranks of ``group`` (float64, one all_reduce) and return them as floats.

    Values may be numbers or one-element tensors on any device; the collective
    runs on the device the group's backend takes (CPU for gloo, this rank's GPU for nccl),
    also with a single worker, so that path is the same at every world size.
    Without a process group the values are returned as they are.
    """
    names = list(values)
    if not names:
        return {}
    device = control_device(group)
    packed = torch.stack([torch.as_tensor(values[n], dtype=torch.float64).to(device).reshape(()) for n in names])
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(packed, group=group)
    return dict(zip(names, packed.tolist()))
