"""Plug any all_reduce into training: a DDP communication hook, and the manual textbook loop.

``allreduce_hook(fn)`` makes a DDP communication hook: DDP still buckets the
gradients and starts each bucket's communication as soon as the bucket's
gradients are ready during ``backward()``; the hook averages the bucket with
``fn`` instead of gloo's or nccl's all_reduce. ``fn`` is synchronous, so the
hook runs it on a background thread and returns a future at once: backward
keeps computing the next buckets while earlier ones are reduced, which is
the overlap DDP exists for::

    backward:  grads of bucket 2 | grads of bucket 1 | grads of bucket 0 | wait
    hook thread:                 | all_reduce b2     | all_reduce b1     | b0

Every hook of a process (one per DDP model: a GAN's generator and
discriminator) hands its buckets to the same single thread, so the
collectives run one at a time in the order the buckets were handed over.
That order is the same on every rank: DDP hands each model's buckets over
in bucket order, and the models' buckets interleave as the (deterministic)
backward makes them ready. With a thread per hook, two models' buckets
would be reduced at once, in an order that differs from rank to rank, and
the ranks would exchange buckets of different models (a size mismatch, or
a hang). grad_sync flat and manual reduce on the training thread at the end
of backward; they first wait for this thread (:func:`finish_hook_collectives`),
for a backward that also ran a DDP model with a hook.

``manual_gradient_sync`` is the baseline without DDP: after ``backward()``,
all-reduce every parameter's gradient one at a time and divide by the
world size. No buckets, no overlap: one message round per parameter, after
all computation. Start it from identical weights on every rank
(``broadcast_parameters``, what DDP does when it wraps a model).
"""

# No `from __future__ import annotations` here: DDP's register_comm_hook checks
# the hook's annotations against dist.GradBucket and Future[Tensor] by identity.
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.distributed as dist
from torch import nn

# GradBucket's home; torch.distributed re-exports it without listing it, so the type checker misses it there.
from torch._C._distributed_c10d import GradBucket

from ddpkit.comm.ops import ReduceOp, divide
from ddpkit.comm.tree import broadcast

AllReduce = Callable[..., None]
CommHook = Callable[[dist.ProcessGroup | None, GradBucket], torch.futures.Future[torch.Tensor]]


def allreduce_hook(all_reduce_fn: AllReduce) -> CommHook:
    """Make a DDP communication hook that averages each gradient bucket with ``all_reduce_fn``.

    Register it with ``ddp_model.register_comm_hook(state, hook)``, where
    ``state`` is the process group to reduce over (None for the world group,
    which is what DDP uses unless it was given ``process_group``).

    Args:
        all_reduce_fn: ``fn(tensor, op=ReduceOp.SUM, group=None)`` reducing in place,
            e.g. ``ddpkit.comm.resolve_allreduce("ring")``.

    Returns:
        ``hook(state, bucket) -> torch.futures.Future[torch.Tensor]`` resolving to
        the bucket's averaged gradients.
    """

    def hook(state: dist.ProcessGroup | None, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
        buffer = bucket.buffer()
        future: torch.futures.Future[torch.Tensor] = torch.futures.Future()

        def run() -> None:
            try:
                all_reduce_fn(buffer, op=ReduceOp.SUM, group=state)
                divide(buffer, dist.get_world_size(state))
            except BaseException as e:  # surface the failure to DDP's wait() on the training thread
                future.set_exception(e)  # type: ignore[arg-type]  # torch's stub types the exception as the result
                return
            future.set_result(buffer)

        _collective_thread().submit(run)
        return future

    return hook


_THREAD_LOCK = threading.Lock()
_THREAD: dict[int, ThreadPoolExecutor] = {}
"""This process's collective thread, keyed by process id: a forked worker starts its own."""


def _collective_thread() -> ThreadPoolExecutor:
    """The one thread on which every communication hook of this process runs its collectives, in order."""
    pid = os.getpid()
    executor = _THREAD.get(pid)
    if executor is None:
        with _THREAD_LOCK:
            executor = _THREAD.get(pid)
            if executor is None:
                _THREAD.clear()  # a parent's thread does not exist in this (forked) process
                executor = _THREAD[pid] = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ddpkit-comm-hook")
    return executor


def finish_hook_collectives() -> None:
    """Wait until every collective handed to the communication hooks' thread so far has run.

    A collective started on another thread (grad_sync flat's at the end of a
    backward that also ran a DDP model's hook) waits for this first, so that
    it comes after the hook's buckets on every rank. Without a hook in this
    process it returns at once.
    """
    executor = _THREAD.get(os.getpid())
    if executor is not None:
        executor.submit(_nothing).result()


def _nothing() -> None:
    """A task that marks a point in the hook thread's queue."""


def register_allreduce_hook(
    model: nn.parallel.DistributedDataParallel, all_reduce_fn: AllReduce, group: dist.ProcessGroup | None = None
) -> None:
    """Make ``model`` (a DDP module) average its gradients with ``all_reduce_fn``.

    Args:
        model: the DistributedDataParallel module, before its first backward.
        all_reduce_fn: ``fn(tensor, op=ReduceOp.SUM, group=None)`` reducing in place.
        group: the group DDP was built with (None for the world group).
    """
    model.register_comm_hook(group, allreduce_hook(all_reduce_fn))


def manual_gradient_sync(
    model: nn.Module, all_reduce_fn: AllReduce, world_size: int, group: dist.ProcessGroup | None = None
) -> None:
    """Average every parameter's ``.grad`` over the ranks, one parameter at a time (call after ``backward()``).

    Parameters whose ``.grad`` is None are skipped; every rank must then have
    None for the same parameters, or the ranks wait on each other forever.

    Args:
        model: the plain (not DDP-wrapped) model, identical on every rank.
        all_reduce_fn: ``fn(tensor, op=ReduceOp.SUM, group=None)`` reducing in place.
        world_size: number of ranks in ``group``.
        group: process group, or None for the world group.
    """
    for param in model.parameters():
        if param.grad is None:
            continue
        all_reduce_fn(param.grad, op=ReduceOp.SUM, group=group)
        divide(param.grad, world_size)


def broadcast_parameters(model: nn.Module, src: int = 0, group: dist.ProcessGroup | None = None) -> None:
    """Copy rank ``src``'s parameters and buffers to every rank, as DDP does when it wraps a model.

    Args:
        model: the model, same architecture on every rank.
        src: rank in ``group`` whose values win.
        group: process group, or None for the world group.
    """
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            if tensor.device.type == "cpu":
                broadcast(tensor, src, group=group)
            else:  # gloo's send/recv would read a CUDA pointer as host memory; the backend's broadcast copes
                dist.broadcast(tensor, dist.get_global_rank(group, src) if group is not None else src, group=group)
