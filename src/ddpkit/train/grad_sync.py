"""How gradients are synchronised: DDP with a chosen all_reduce, or the manual loop.

``allreduce=auto`` takes the shared-memory all_reduce when every worker is on
one node and trains on the CPU (gloo would move the bytes over TCP loopback),
and the backend's built-in otherwise. Any other name selects an algorithm of
``ddpkit.comm``, plugged into DDP as a communication hook so DDP's bucketing
and overlap with backward stay.
"""

from __future__ import annotations

from collections.abc import Callable

import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ddpkit.distributed import Context


def choose_allreduce(requested: str, ctx: Context) -> str:
    """The all_reduce algorithm name to use for ``requested`` (resolving auto)."""
    if requested != "auto":
        return requested
    if ctx.device.type == "cpu" and ctx.env.is_single_node and ctx.world_size > 1:
        from ddpkit.comm import shm

        if shm.is_available():
            return "shm"
        shm.warn_unavailable_once()
    return "builtin"


def wrap_model(model: nn.Module, ctx: Context, allreduce: str, grad_sync: str) -> nn.Module:
    """Make ``model`` data-parallel (or return it as is for one worker).

    Args:
        model: the model, already on ``ctx.device``.
        ctx: the worker's context.
        allreduce: algorithm name (already resolved by choose_allreduce).
        grad_sync: ddp or manual.
    """
    if ctx.world_size == 1:
        return model
    if grad_sync == "manual":
        from ddpkit.comm.hooks import broadcast_parameters

        broadcast_parameters(model)  # start from rank 0's weights, as DDP does
        return model
    device_ids = [ctx.device.index] if ctx.device.type == "cuda" else None
    ddp = DDP(model, device_ids=device_ids)
    if allreduce != "builtin":
        from ddpkit.comm.hooks import register_allreduce_hook

        register_allreduce_hook(ddp, _resolve(allreduce))
    return ddp


def manual_sync_fn(ctx: Context, allreduce: str, grad_sync: str) -> Callable[[nn.Module], None] | None:
    """For grad_sync=manual with several workers, the function averaging gradients after backward."""
    if grad_sync != "manual" or ctx.world_size == 1:
        return None
    from ddpkit.comm.hooks import manual_gradient_sync

    fn = _resolve(allreduce)
    return lambda model: manual_gradient_sync(model, fn, ctx.world_size)


def _resolve(name: str) -> Callable[..., object]:
    if name == "builtin":
        return dist.all_reduce
    from ddpkit.comm.registry import resolve_allreduce

    return resolve_allreduce(name)


def describe(allreduce: str, grad_sync: str, ctx: Context) -> str:
    """One line for the start-up log."""
    if ctx.world_size == 1:
        return "single worker: no gradient synchronisation"
    return f"gradients: {grad_sync} with all_reduce={allreduce} over {ctx.backend}"


