"""Rank 0's buffers on every rank before each forward, as DDP's ``broadcast_buffers=True`` does.

A BatchNorm layer updates its running statistics (``running_mean``,
``running_var``, ``num_batches_tracked``) from each rank's own batch, so they
drift apart between ranks unless someone copies them. DDP broadcasts the
module's buffers from rank 0 before every forward that is to synchronise
gradients (grad enabled, not inside ``no_sync()``); ``grad_sync=flat`` and
``manual`` do the same with :func:`broadcast_buffers`, in one collective::

    rank 0:  buffers -> bytes of one flat tensor --broadcast-->  (unchanged)
    rank r:  flat tensor <--------------------------------------  copied back into its buffers

One broadcast of ``B`` buffer bytes per forward and device (``B`` received
per rank other than 0), one copy in on rank 0 and one copy out on the
others. A model without buffers registers nothing and pays nothing.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


def broadcast_buffers(model: nn.Module, src: int = 0, group: dist.ProcessGroup | None = None) -> None:
    """Copy rank ``src``'s buffers of ``model`` to every rank of ``group``, one broadcast per device.

    Buffers of every dtype travel together as bytes, so a BatchNorm's float
    statistics and its int64 counter take one collective.

    Args:
        model: the model, the same architecture on every rank.
        src: rank in ``group`` whose buffers win.
        group: process group, or None for the world group.
    """
    buffers = list(model.buffers())
    root = dist.get_global_rank(group, src) if group is not None else src
    is_root = dist.get_rank(group) == src
    # (A private torch helper, the one DDP uses, missing from torch.autograd's __all__.)
    preserve = torch.autograd._unsafe_preserve_version_counter  # type: ignore[attr-defined]
    with torch.no_grad(), preserve(tuple(buffers)):
        # The version counters stay as they were, as in DDP: a graph that saved a buffer (BatchNorm in
        # eval mode) is not invalidated by receiving the values it already had on rank 0.
        for device in dict.fromkeys(b.device for b in buffers):
            # Widest elements first: every buffer then starts at an offset its dtype can be viewed at.
            members = sorted((b for b in buffers if b.device == device), key=lambda b: -b.element_size())
            packed = torch.cat([b.reshape(-1).view(torch.uint8) for b in members])
            dist.broadcast(packed, root, group=group)
            if not is_root:
                for buffer, part in zip(members, packed.split([b.numel() * b.element_size() for b in members])):
                    buffer.copy_(part.view(buffer.dtype).view(buffer.shape))


def has_buffers(model: nn.Module) -> bool:
    """Whether ``model`` holds any buffer (BatchNorm's statistics, a registered mask)."""
    return next(model.buffers(), None) is not None
