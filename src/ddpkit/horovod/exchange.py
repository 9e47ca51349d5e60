"""Horovod's collectives that move data: allgather, broadcast and alltoall; and join and barrier.

As in :mod:`ddpkit.horovod.ops` (the handles and allreduce), each
``*_async`` function queues the collective on this rank's background thread
and returns a handle for ``synchronize``; names ending in ``_`` work in
place, and allgather and broadcast are differentiable (their gradients are
allreduces, as in Horovod). A rank that called :func:`join` contributes no
rows to allgather; a broadcast from a joined rank fails.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

import torch

from ddpkit.horovod import engine
from ddpkit.horovod.engine import ALLGATHER, ALLTOALL, BARRIER, BROADCAST, Call, Rows
from ddpkit.horovod.ops import Average, allreduce, new_handle, synchronize
from ddpkit.horovod.process_sets import check as check_process_set, global_process_set

# -- allgather ------------------------------------------------------------------------------


def allgather_async(tensor: torch.Tensor, name: str | None = None, process_set: object = global_process_set) -> int:
    """Queue an allgather; ``synchronize`` returns the ranks' tensors concatenated along dimension 0."""
    return new_handle(_allgather(tensor, name, process_set))


def allgather(tensor: torch.Tensor, name: str | None = None, process_set: object = global_process_set) -> torch.Tensor:
    """Every rank's ``tensor`` concatenated along dimension 0, in rank order; differentiable.

    The first dimension may differ between ranks; the others and the dtype must agree.
    """
    result: torch.Tensor = _Allgather.apply(tensor, name, process_set)
    return result


def _allgather(tensor: torch.Tensor, name: str | None, process_set: object, with_dims: bool = False) -> Future[Any]:
    check_process_set(process_set)
    rows_shape = tuple(tensor.shape) if tensor.dim() else (1,)
    trailing = rows_shape[1:]
    source = tensor.detach().reshape(-1)
    call = Call(
        ALLGATHER, dtype=tensor.dtype, dim0=rows_shape[0], row_numel=math.prod(trailing), shape=trailing, name=name
    )
    eng = engine.current()

    def run(rows: Rows) -> Any:
        parts = eng.all_gather(rows, source)
        out = torch.cat(parts).view(-1, *trailing)
        return (out, [p.numel() // max(1, math.prod(trailing)) for p in parts]) if with_dims else out

    return eng.submit(call, run)


class _Allgather(torch.autograd.Function):
    """allgather with a gradient: this rank's rows of the averaged incoming gradient (as Horovod)."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: str | None, process_set: object) -> torch.Tensor:
        gathered: tuple[torch.Tensor, list[int]] = _allgather(tensor, name, process_set, with_dims=True).result()
        out, dims = gathered
        ctx.rows = (sum(dims[: engine.current().rank]), dims[engine.current().rank], tuple(tensor.shape))
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        offset, count, shape = ctx.rows
        reduced = allreduce(grad, op=Average)
        return reduced.narrow(0, offset, count).reshape(shape), None, None


# -- broadcast ------------------------------------------------------------------------------


def broadcast_async(
    tensor: torch.Tensor, root_rank: int, name: str | None = None, process_set: object = global_process_set
) -> int:
    """Queue a broadcast from ``root_rank`` into a new tensor; ``synchronize`` returns it."""
    return new_handle(_broadcast(tensor.detach().clone(), root_rank, name, process_set))


def broadcast_async_(
    tensor: torch.Tensor, root_rank: int, name: str | None = None, process_set: object = global_process_set
) -> int:
    """Queue a broadcast from ``root_rank`` into ``tensor`` itself; ``synchronize`` returns it."""
    return new_handle(_broadcast(tensor, root_rank, name, process_set))


def broadcast(
    tensor: torch.Tensor, root_rank: int, name: str | None = None, process_set: object = global_process_set
) -> torch.Tensor:
    """Rank ``root_rank``'s ``tensor``, as a new tensor on every rank; differentiable."""
    result: torch.Tensor = _Broadcast.apply(tensor, root_rank, name, process_set)
    return result


def broadcast_(
    tensor: torch.Tensor, root_rank: int, name: str | None = None, process_set: object = global_process_set
) -> torch.Tensor:
    """Overwrite ``tensor`` with rank ``root_rank``'s and return it."""
    result: torch.Tensor = synchronize(broadcast_async_(tensor, root_rank, name, process_set))
    return result


def _broadcast(output: torch.Tensor, root_rank: int, name: str | None, process_set: object) -> Future[Any]:
    check_process_set(process_set)
    eng = engine.current()
    if not 0 <= root_rank < eng.world_size:
        raise ValueError(
            f"root_rank={root_rank} is not a rank of this job of {eng.world_size}; pass 0..{eng.world_size - 1}"
        )
    result, output = output, output.detach()
    call = Call(
        BROADCAST, dtype=output.dtype, root=root_rank, row_numel=output.numel(), shape=tuple(output.shape), name=name
    )

    def run(rows: Rows) -> torch.Tensor:
        flat = output.view(-1) if output.is_contiguous() else output.reshape(-1).clone()
        eng.broadcast(rows, flat)
        if flat.data_ptr() != output.data_ptr():
            output.copy_(flat.view_as(output))
        return result

    return eng.submit(call, run)


class _Broadcast(torch.autograd.Function):
    """broadcast with a gradient: the averaged incoming gradient on the root, zero elsewhere (as Horovod)."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, root_rank: int, name: str | None, process_set: object) -> torch.Tensor:
        ctx.root_rank = root_rank
        result: torch.Tensor = _broadcast(tensor.detach().clone(), root_rank, name, process_set).result()
        return result

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        reduced = allreduce(grad, op=Average)
        if engine.current().rank != ctx.root_rank:
            reduced = reduced * 0
        return reduced, None, None, None


# -- alltoall, join, barrier ------------------------------------------------------------------


def alltoall_async(
    tensor: torch.Tensor,
    splits: Sequence[int] | torch.Tensor | None = None,
    name: str | None = None,
    process_set: object = global_process_set,
) -> int:
    """Queue an alltoall; ``synchronize`` returns ``(output, received_splits)``."""
    check_process_set(process_set)
    eng = engine.current()
    rows_shape = tuple(tensor.shape) if tensor.dim() else (1,)
    dim0, trailing = rows_shape[0], rows_shape[1:]
    if splits is None:
        if dim0 % eng.world_size:
            raise ValueError(
                f"alltoall without splits divides the first dimension ({dim0}) evenly over "
                f"{eng.world_size} ranks; pass splits= (rows for each rank)"
            )
        splits = [dim0 // eng.world_size] * eng.world_size
    splits = [int(s) for s in (splits.tolist() if isinstance(splits, torch.Tensor) else splits)]
    if len(splits) != eng.world_size or sum(splits) != dim0 or min(splits) < 0:
        raise ValueError(
            f"alltoall splits {splits} must be {eng.world_size} non-negative row counts adding up to "
            f"the first dimension, {dim0}"
        )
    source = tensor.detach().reshape(-1).contiguous()
    call = Call(
        ALLTOALL, dtype=tensor.dtype, dim0=dim0, row_numel=math.prod(trailing), shape=trailing, name=name, splits=splits
    )

    def run(rows: Rows) -> tuple[torch.Tensor, torch.Tensor]:
        out, received = eng.all_to_all(rows, source)
        return out.view(-1, *trailing), torch.tensor(received, dtype=torch.int32)

    return new_handle(eng.submit(call, run))


def alltoall(
    tensor: torch.Tensor,
    splits: Sequence[int] | torch.Tensor | None = None,
    name: str | None = None,
    process_set: object = global_process_set,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Send ``splits[r]`` rows of ``tensor`` (in order) to each rank r; receive the rows sent here.

    Without ``splits`` the first dimension is divided evenly over the ranks.

    Returns:
        The received rows, concatenated in rank order; with ``splits``, also
        a tensor of how many rows came from each rank (as Horovod).
    """
    output, received = synchronize(alltoall_async(tensor, splits, name, process_set))
    return output if splits is None else (output, received)


def join(device: int = -1) -> int:
    """Declare that this rank has no more data; take part in the others' collectives until all have joined.

    Until every rank has called join, this rank contributes zeros to the other
    ranks' allreduces (Average still divides by every rank) and no rows to
    their allgathers; a broadcast from a joined rank fails.

    Args:
        device: accepted for Horovod compatibility; unused.

    Returns:
        The rank that joined last.
    """
    return engine.current().join()


def barrier(process_set: object = global_process_set) -> None:
    """Wait until every rank has reached the barrier (after this rank's queued collectives)."""
    check_process_set(process_set)
    eng = engine.current()
    eng.submit(Call(BARRIER), lambda rows: None).result()
