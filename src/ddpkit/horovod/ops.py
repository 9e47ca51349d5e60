"""Horovod's handles and allreduce (:mod:`ddpkit.horovod.exchange` has allgather, broadcast, alltoall, join, barrier).

Each ``*_async`` function queues the collective on this rank's background
thread (:mod:`ddpkit.horovod.engine`) and returns an integer handle at once;
``synchronize(handle)`` waits for it and returns its result, ``poll(handle)``
says whether it is done. The plain functions are the async ones followed by
``synchronize``. Names ending in ``_`` work in place; the others return a
new tensor and, where Horovod does, are differentiable (the gradient of an
allreduce is the allreduce of the gradient).

``allreduce`` averages by default (``op=Average``); ``Sum, Min, Max,
Product`` are the other operators. ``Adasum`` raises
:class:`~ddpkit.horovod.unsupported.HorovodUnsupportedError`.
``prescale_factor`` multiplies each rank's tensor before the reduction,
``postscale_factor`` the result after it (after the division by the number
of ranks, for Average). ``name=`` is accepted and checked to agree across
ranks; collectives are matched by call order, not by name.

A rank that called :func:`join` contributes zeros to allreduce (the
neutral element for Min, Max and Product) and no rows to allgather; an
Average still divides by the number of ranks, joined ones included, as in
Horovod.
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

import torch

from ddpkit.horovod import engine
from ddpkit.horovod.compression import Compression, Compressor
from ddpkit.horovod.engine import ALLREDUCE, REDUCE_OPS, Call
from ddpkit.horovod.process_sets import check as check_process_set, global_process_set
from ddpkit.horovod.unsupported import ADASUM, HorovodUnsupportedError


class ReduceOp(enum.IntEnum):
    """Horovod's reduction operators."""

    AVERAGE = 0
    SUM = 1
    ADASUM = 2
    MIN = 3
    MAX = 4
    PRODUCT = 5


Average = ReduceOp.AVERAGE
Sum = ReduceOp.SUM
Adasum = ReduceOp.ADASUM
Min = ReduceOp.MIN
Max = ReduceOp.MAX
Product = ReduceOp.PRODUCT

_ENGINE_OP = {Average: 0, Sum: 0, Min: 1, Max: 2, Product: 3}  # index in engine.REDUCE_OPS; Average sums first
assert [REDUCE_OPS[i].name for i in (0, 1, 2, 3)] == ["SUM", "MIN", "MAX", "PRODUCT"]

_futures: dict[int, Future[Any]] = {}
_handle_numbers = itertools.count()


# -- handles ------------------------------------------------------------------------------


def poll(handle: int) -> bool:
    """Whether the collective behind ``handle`` has finished (``synchronize`` would not wait)."""
    return _future(handle).done()


def synchronize(handle: int) -> Any:
    """Wait for the collective behind ``handle`` and return its result (the output tensor).

    Raises:
        ValueError: unknown or already synchronized handle.
        RuntimeError: the collective failed (ranks disagreed, a peer left).
    """
    future = _future(handle)
    del _futures[handle]
    return future.result()


def _future(handle: int) -> Future[Any]:
    try:
        return _futures[handle]
    except KeyError:
        raise ValueError(
            f"handle {handle} is unknown or was already synchronized; synchronize each handle once"
        ) from None


def new_handle(future: Future[Any]) -> int:
    """A new handle for ``future``, for ``poll`` and ``synchronize``."""
    number = next(_handle_numbers)
    _futures[number] = future
    return number


# -- allreduce ------------------------------------------------------------------------------


def allreduce_async(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    op: ReduceOp | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: object = global_process_set,
) -> int:
    """Queue an allreduce of ``tensor`` into a new tensor; ``synchronize`` returns it."""
    return new_handle(
        _allreduce(tensor, tensor.detach().clone(), average, name, op, prescale_factor, postscale_factor, process_set)
    )


def allreduce_async_(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    op: ReduceOp | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: object = global_process_set,
) -> int:
    """Queue an allreduce of ``tensor`` in place; ``synchronize`` returns ``tensor``."""
    return new_handle(_allreduce(tensor, tensor, average, name, op, prescale_factor, postscale_factor, process_set))


def allreduce(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    compression: type[Compressor] = Compression.none,
    op: ReduceOp | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: object = global_process_set,
) -> torch.Tensor:
    """The reduction (Average by default) of ``tensor`` over every rank, as a new tensor; differentiable.

    Args:
        tensor: the same shape and dtype on every rank.
        average: deprecated; True is op=Average, False op=Sum.
        name: a name for the collective (checked to agree across ranks).
        compression: ``Compression.none`` or ``Compression.fp16`` (reduced in float16).
        op: Average, Sum, Min, Max or Product.
        prescale_factor: multiplies the input before the reduction.
        postscale_factor: multiplies the result after it.
        process_set: the global process set only.

    Raises:
        HorovodUnsupportedError: op=Adasum, or another process set.
    """
    op = _reduce_op(average, op)
    compressed, ctx = compression.compress(tensor)
    reduced = _Allreduce.apply(compressed, op, prescale_factor, postscale_factor, name, process_set)
    return compression.decompress(reduced, ctx)


def allreduce_(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    op: ReduceOp | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: object = global_process_set,
) -> torch.Tensor:
    """Reduce ``tensor`` in place over every rank (Average by default) and return it."""
    result: torch.Tensor = synchronize(
        allreduce_async_(tensor, average, name, op, prescale_factor, postscale_factor, process_set)
    )
    return result


def grouped_allreduce_async_(
    tensors: Sequence[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    op: ReduceOp | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: object = global_process_set,
) -> int:
    """Queue one allreduce of all ``tensors`` (same dtype) in place; ``synchronize`` returns the list."""
    return new_handle(
        _grouped(list(tensors), list(tensors), average, name, op, prescale_factor, postscale_factor, process_set)
    )


def grouped_allreduce_async(
    tensors: Sequence[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    op: ReduceOp | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: object = global_process_set,
) -> int:
    """Queue one allreduce of all ``tensors`` into new tensors; ``synchronize`` returns them."""
    outputs = [t.detach().clone() for t in tensors]
    return new_handle(
        _grouped(list(tensors), outputs, average, name, op, prescale_factor, postscale_factor, process_set)
    )


def grouped_allreduce(
    tensors: Sequence[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    op: ReduceOp | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: object = global_process_set,
) -> list[torch.Tensor]:
    """The reductions of ``tensors``, moved as one collective, as new tensors."""
    result: list[torch.Tensor] = synchronize(
        grouped_allreduce_async(tensors, average, name, op, prescale_factor, postscale_factor, process_set)
    )
    return result


def grouped_allreduce_(
    tensors: Sequence[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    op: ReduceOp | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: object = global_process_set,
) -> list[torch.Tensor]:
    """Reduce ``tensors`` in place, as one collective, and return them."""
    result: list[torch.Tensor] = synchronize(
        grouped_allreduce_async_(tensors, average, name, op, prescale_factor, postscale_factor, process_set)
    )
    return result


def _reduce_op(average: bool | None, op: ReduceOp | None) -> ReduceOp:
    if average is not None:
        if op is not None:
            raise ValueError("allreduce got both op= and the deprecated average=; pass op= only")
        return Average if average else Sum
    op = Average if op is None else ReduceOp(op)
    if op == Adasum:
        raise HorovodUnsupportedError(ADASUM)
    return op


def _allreduce(
    tensor: torch.Tensor,
    output: torch.Tensor,
    average: bool | None,
    name: str | None,
    op: ReduceOp | None,
    prescale: float,
    postscale: float,
    process_set: object,
) -> Future[Any]:
    return _grouped([tensor], [output], average, name, op, prescale, postscale, process_set, single=True)


def _grouped(
    tensors: list[torch.Tensor],
    outputs: list[torch.Tensor],
    average: bool | None,
    name: str | None,
    op: ReduceOp | None,
    prescale: float,
    postscale: float,
    process_set: object,
    single: bool = False,
) -> Future[Any]:
    check_process_set(process_set)
    op = _reduce_op(average, op)
    if len({t.dtype for t in tensors}) > 1:
        raise ValueError("grouped_allreduce needs tensors of one dtype; group tensors by dtype")
    dtype = tensors[0].dtype if tensors else torch.float32
    if not tensors:
        raise ValueError("grouped_allreduce got no tensors; pass at least one")
    results, outputs = outputs, [o.detach() for o in outputs]  # the in-place work must not be recorded by autograd
    shape = tuple(tensors[0].shape) if single else tuple(tuple(t.shape) for t in tensors)
    numel = sum(t.numel() for t in tensors)
    call = Call(ALLREDUCE, dtype=dtype, op=_ENGINE_OP[op], row_numel=numel, shape=shape, name=name)
    eng = engine.current()
    in_place = single and outputs[0].is_contiguous()  # reduce the output's own memory, no copy

    def prepare() -> torch.Tensor:
        flat = outputs[0].view(-1) if in_place else torch.cat([o.reshape(-1) for o in outputs])
        _scale(flat, prescale)
        return flat

    def finish(flat: torch.Tensor) -> Any:
        if op == Average:
            _divide(flat, eng.world_size)
        _scale(flat, postscale)
        if not (in_place and flat.data_ptr() == outputs[0].data_ptr()):  # fused: a part of a shared buffer
            for out, part in zip(outputs, torch.split(flat, [o.numel() for o in outputs])):
                out.copy_(part.view_as(out))
        return results[0] if single else results

    device = outputs[0].device if outputs else eng.device
    return eng.submit_allreduce(call, prepare, finish, device)


def _scale(flat: torch.Tensor, factor: float) -> None:
    if factor == 1.0:
        return
    if flat.dtype.is_floating_point or flat.dtype.is_complex:
        flat.mul_(factor)
    else:
        flat.copy_(flat * factor)  # integers: scaled in floating point, truncated back


def _divide(flat: torch.Tensor, world_size: int) -> None:
    if flat.dtype.is_floating_point or flat.dtype.is_complex:
        flat.div_(world_size)
    else:
        flat.div_(world_size, rounding_mode="trunc")


class _Allreduce(torch.autograd.Function):
    """allreduce with a gradient: the same allreduce of the incoming gradient."""

    @staticmethod
    def forward(
        ctx: Any,
        tensor: torch.Tensor,
        op: ReduceOp,
        prescale: float,
        postscale: float,
        name: str | None,
        process_set: object,
    ) -> torch.Tensor:
        ctx.args = (op, prescale, postscale, process_set)
        result: torch.Tensor = synchronize(
            new_handle(_allreduce(tensor, tensor.detach().clone(), None, name, op, prescale, postscale, process_set))
        )
        return result

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        op, prescale, postscale, process_set = ctx.args
        return (
            allreduce(grad, op=op, prescale_factor=prescale, postscale_factor=postscale, process_set=process_set),
            None,
            None,
            None,
            None,
            None,
        )
