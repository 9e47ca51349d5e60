"""How gradients are synchronised: which all_reduce, and DDP, one flat all_reduce or the manual loop.

``allreduce=auto`` on the CPU takes the shared-memory all_reduce when every
worker is on one node (gloo would move the bytes over TCP loopback), the
hierarchical one (shared memory inside each node, gloo between nodes) when
the job spans nodes with several workers on some, and the backend's built-in
otherwise (one worker per node, or CUDA). Any other name selects an
algorithm of ``ddpkit.comm``.

``grad_sync=auto`` takes ``flat`` (``ddpkit.comm.flat_grads``: gradients as
views of one buffer, one all_reduce after backward) when the gradients fit in
DDP's first bucket, where DDP has a single bucket and so no overlap with
backward to offer, only its per-parameter hooks and copies; and ``ddp``
(the chosen all_reduce as DDP's communication hook, buckets overlapping
backward) for larger models or with SyncBatchNorm. ``manual`` is the
textbook per-parameter loop, kept as a baseline.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ddpkit.comm.flat_grads import DDP_FIRST_BUCKET_BYTES, FlatGradients, gradient_bytes
from ddpkit.distributed import Context
from ddpkit.log import get_logger


def choose_allreduce(requested: str, ctx: Context) -> str:
    """The all_reduce algorithm name to use for ``requested``, resolving auto (collective: every rank calls it)."""
    if requested != "auto":
        return requested
    if ctx.device.type != "cpu" or ctx.world_size == 1:
        return "builtin"
    if ctx.env.is_single_node:
        candidate = "shm"
    elif ctx.world_size > ctx.env.num_nodes:  # some node holds several ranks: share memory there
        candidate = "hierarchical"
    else:  # one rank per node: nothing to share memory with
        return "builtin"
    from ddpkit.comm import shm

    available = shm.is_available()
    if _on_every_rank(available):
        return candidate
    if not available:
        shm.warn_unavailable_once()
    else:
        get_logger().warning(f"allreduce=auto: another rank cannot load the shared-memory library; "
                             f"using builtin instead of {candidate}")
    return "builtin"


def _on_every_rank(flag: bool) -> bool:
    """Whether ``flag`` holds on every rank (all ranks must pick the same algorithm, or they wait on each other)."""
    agreed = torch.tensor([int(flag)], dtype=torch.int32)
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
    return bool(agreed.item())


def choose_grad_sync(requested: str, model: nn.Module, sync_batchnorm: bool) -> str:
    """The gradient synchronisation mode for ``requested`` (resolving auto for ``model``)."""
    if requested != "auto":
        return requested
    if sync_batchnorm:  # torch supports SyncBatchNorm inside DDP only
        return "ddp"
    return "flat" if gradient_bytes(model) <= DDP_FIRST_BUCKET_BYTES else "ddp"


class GradientSync:
    """This worker's part in making every gradient the mean over the workers.

    The training loop calls the model through ``model``, zeroes gradients with
    ``zero_grad``, runs the micro-batches of gradient accumulation but the last
    inside ``accumulating()``, and calls ``synchronize()`` after the step's
    last backward.

    Args:
        model: the model, already on ``ctx.device`` (and with its own weights on every rank).
        ctx: the worker's context.
        allreduce: algorithm name (resolved by choose_allreduce).
        mode: ddp, flat or manual (resolved by choose_grad_sync); ignored for one worker.
    """

    def __init__(self, model: nn.Module, ctx: Context, allreduce: str, mode: str) -> None:
        self.ctx = ctx
        self.allreduce = allreduce
        self.mode = mode if ctx.world_size > 1 else "none"
        self.model = model
        self.flat: FlatGradients | None = None
        self._manual: Callable[[], None] | None = None
        if self.mode == "ddp":
            self.model = _wrap_ddp(model, ctx, allreduce)
            return
        if self.mode in ("flat", "manual"):
            from ddpkit.comm.hooks import broadcast_parameters, manual_gradient_sync

            broadcast_parameters(model)  # start from rank 0's weights, as DDP does
            fn = _resolve(allreduce)
            if self.mode == "flat":
                self.flat = FlatGradients(model, fn)
            else:
                self._manual = lambda: manual_gradient_sync(model, fn, ctx.world_size)

    def zero_grad(self, optimizer: torch.optim.Optimizer) -> None:
        """Zero the gradients before a step (the flat buffer keeps its views)."""
        if self.flat is not None:
            self.flat.zero_grad()
        else:
            optimizer.zero_grad(set_to_none=True)

    def accumulating(self) -> contextlib.AbstractContextManager:
        """Context for a backward whose gradients must not be synchronised yet (not the step's last)."""
        return self.model.no_sync() if self.mode == "ddp" else contextlib.nullcontext()

    def synchronize(self) -> None:
        """After the step's last backward: average the gradients (DDP did it during backward)."""
        if self.flat is not None:
            self.flat.all_reduce()
        elif self._manual is not None:
            self._manual()

    def describe(self) -> str:
        """One line for the start-up log."""
        if self.mode == "none":
            return "single worker: no gradient synchronisation"
        detail = f" of {self.flat.nbytes / 1024:.0f} KiB" if self.flat is not None else ""
        return f"gradients: {self.mode}{detail} with all_reduce={self.allreduce} over {self.ctx.backend}"


def _wrap_ddp(model: nn.Module, ctx: Context, allreduce: str) -> DDP:
    device_ids = [ctx.device.index] if ctx.device.type == "cuda" else None
    ddp = DDP(model, device_ids=device_ids)
    if allreduce != "builtin":
        from ddpkit.comm.hooks import register_allreduce_hook

        register_allreduce_hook(ddp, _resolve(allreduce))
    return ddp


def _resolve(name: str) -> Callable[..., object]:
    if name == "builtin":
        return dist.all_reduce
    from ddpkit.comm.registry import resolve_allreduce

    return resolve_allreduce(name)
