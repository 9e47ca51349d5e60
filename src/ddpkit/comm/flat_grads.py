"""Average all gradients with one all_reduce: the lightest data-parallel path for small models.

DDP registers an autograd hook per parameter, copies gradients into buckets
and hands each bucket to a communication hook, so that communication
overlaps the rest of backward. For a model whose gradients fit in DDP's
first bucket (1 MiB) there is nothing to overlap: the one bucket is ready
only when backward ends. ``FlatGradients`` does the same work without the
machinery: every parameter's ``.grad`` is a view into one contiguous buffer
(what DDP calls ``gradient_as_bucket_view``), autograd accumulates into the
views in place, and after backward one call reduces the whole buffer::

    sync = FlatGradients(model, ddpkit.comm.shm.all_reduce)
    for x, y in batches:
        sync.zero_grad()                       # not optimizer.zero_grad(): keep the views
        loss_fn(model(x), y).backward()
        sync.all_reduce()                      # grads are now the mean over ranks
        optimizer.step()

Start every rank from the same weights (``broadcast_parameters``), as DDP does.
``ddpkit.prepare_model`` (``grad_sync=flat``) keeps the loop plain instead:
after each backward, ``take_back_views`` copies in the gradients that autograd
handed out fresh (after ``optimizer.zero_grad()``, whose ``set_to_none=True``
drops the views) before ``reduce_buffers`` (see ``ddpkit.comm.grad_sync``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from ddpkit.comm.ops import ReduceOp, divide

DDP_FIRST_BUCKET_BYTES = 1024 * 1024
"""Size of DDP's first gradient bucket: below it DDP has a single bucket and no overlap to offer."""


class FlatGradients:
    """The gradients of ``model``'s trainable parameters as views of one buffer per dtype and device.

    Args:
        model: the plain (not DDP-wrapped) model, identical on every rank.
        all_reduce_fn: ``fn(tensor, op=ReduceOp.SUM, group=None)`` reducing in place.
        group: process group, or None for the world group.
        averaging: ``all_reduce_fn`` takes ``op=ReduceOp.AVG`` (every ddpkit algorithm does, gloo's
            built-in does not): the reduction then averages, which the shared-memory all_reduce does
            in the same pass, instead of a sum followed by a pass dividing the buffer.
    """

    def __init__(
        self,
        model: nn.Module,
        all_reduce_fn: Callable[..., None],
        group: dist.ProcessGroup | None = None,
        averaging: bool = False,
    ) -> None:
        self.all_reduce_fn = all_reduce_fn
        self.group = group
        self.averaging = averaging
        self.world_size = dist.get_world_size(group)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.buffers: list[torch.Tensor] = []
        for key in dict.fromkeys((p.dtype, p.device) for p in self.params):
            members = [p for p in self.params if (p.dtype, p.device) == key]
            buffer = torch.zeros(sum(p.numel() for p in members), dtype=key[0], device=key[1])
            offset = 0
            for p in members:
                p.grad = buffer[offset : offset + p.numel()].view_as(p)
                offset += p.numel()
            self.buffers.append(buffer)
        self.views: list[torch.Tensor] = []
        for p in self.params:
            assert p.grad is not None, "set to its view of a buffer above"
            self.views.append(p.grad)
        self._pairs = list(zip(self.params, self.views))

    def zero_grad(self) -> None:
        """Zero the buffers, and give back its view to any parameter whose ``.grad`` was replaced or dropped."""
        for buffer in self.buffers:
            buffer.zero_()
        for param, view in self._pairs:
            if param.grad is not view:  # e.g. a zero_grad(set_to_none=True) elsewhere
                param.grad = view

    def take_back_views(self) -> None:
        """Make every ``.grad`` its view again: a gradient set elsewhere is copied in, a missing one counts as zero.

        Call it after a backward that may have started with ``.grad`` None or
        replaced: autograd then hands over the gradient it computed, not the view.
        """
        for param, view in self._pairs:
            grad = param.grad
            if grad is not view:
                if grad is None:
                    view.zero_()
                else:
                    view.copy_(grad)
                param.grad = view

    def all_reduce(self) -> None:
        """Replace every gradient by its mean over the ranks (call after the step's last backward)."""
        for param, view in self._pairs:
            if param.grad is not view:
                raise RuntimeError(
                    "a parameter's .grad is no longer a view of the flat gradient buffer, so it would not be "
                    "averaged; zero gradients with FlatGradients.zero_grad(), not zero_grad(set_to_none=True)"
                )
        self.reduce_buffers()

    def reduce_buffers(self) -> None:
        """Replace the buffers by their mean over the ranks, not checking that every ``.grad`` is its view."""
        for buffer in self.buffers:
            if self.averaging:
                self.all_reduce_fn(buffer, op=ReduceOp.AVG, group=self.group)
            else:
                self.all_reduce_fn(buffer, op=ReduceOp.SUM, group=self.group)
                divide(buffer, self.world_size)

    @property
    def nbytes(self) -> int:
        """Bytes reduced per step."""
        return sum(b.numel() * b.element_size() for b in self.buffers)


def gradient_bytes(model: nn.Module) -> int:
    """Bytes of the gradients of ``model``'s trainable parameters."""
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
