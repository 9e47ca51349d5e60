"""Reduction operators: which ``ReduceOp`` works on which dtype, and how it is applied.

Every collective reduces with :func:`reduce_into` (``acc = acc op other``, in
place, no allocation) and finishes with :func:`finish`, so the meaning of an
operator is defined once; every all_reduce algorithm runs inside
:func:`run_all_reduce`, which checks the operator first and finishes it last:

========== ======================== ==========================================
op         dtypes                   result
========== ======================== ==========================================
SUM        all                      sum of the ranks' values
PRODUCT    all                      product
MIN, MAX   all but complex          element-wise minimum / maximum
AVG        all                      SUM, then divided by the group size
BAND, BOR, integer and bool         bitwise and / or / xor
BXOR
========== ======================== ==========================================

AVG on integer tensors: the sum is divided by the group size and rounded
toward zero (``torch.div(..., rounding_mode="trunc")``), the rule of C integer
division and of NCCL's integer average; gloo's built-in AVG rejects integer
tensors. The sum itself is taken in the tensor's dtype, so it can overflow
where the average would not.

Floating-point SUM and AVG depend on the order in which ranks' values are
added; each algorithm adds in its own order, so results agree with
``dist.all_reduce`` to rounding, not bit for bit. Every algorithm does give the
*same* bits on every rank: each element is reduced on one rank and then copied.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from ddpkit.comm import chunks, p2p

ReduceOp = dist.ReduceOp
RedOpType = dist.ReduceOp.RedOpType
Op = ReduceOp | RedOpType
"""An operator as callers pass it: ``ReduceOp.SUM`` and friends (``RedOpType`` in torch's stubs) or a ``ReduceOp``."""

AllReduceAlgorithm = Callable[[torch.Tensor, RedOpType, int, int, dist.ProcessGroup | None], None]
"""``algorithm(flat, op, rank, world_size, group)``: reduce the contiguous 1-d ``flat`` in place across ``group``."""

_BITWISE = (ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR)
SUPPORTED_OPS = (ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.AVG, *_BITWISE)
"""Operators every ddpkit collective accepts."""

_valid: set[tuple[RedOpType, torch.dtype]] = set()  # (op, dtype) pairs already checked


def check(op: Op, dtype: torch.dtype) -> RedOpType:
    """Validate ``op`` for ``dtype`` and return it as a plain ``ReduceOp.RedOpType``.

    Args:
        op: ``ReduceOp.SUM`` and friends (a ``ReduceOp`` instance is accepted too).
        dtype: dtype of the tensor being reduced.

    Returns:
        The operator as a ``ReduceOp.RedOpType`` (hashable, comparable with ``ReduceOp.SUM``).

    Raises:
        ValueError: the operator is not supported, or not for this dtype.
    """
    # A ReduceOp instance carries its RedOpType in .op, which torch's stub leaves out.
    op_type = op if isinstance(op, RedOpType) else op.op  # type: ignore[attr-defined]
    key = (op_type, dtype)
    if key in _valid:  # every collective call starts here: keep the common case cheap
        return op_type
    if op_type not in SUPPORTED_OPS:
        names = ", ".join(o.name for o in SUPPORTED_OPS)
        raise ValueError(f"reduce op {op_type} is not supported by ddpkit.comm; use one of {names}")
    if op_type in _BITWISE and (dtype.is_floating_point or dtype.is_complex):
        raise ValueError(f"ReduceOp.{op_type.name} needs an integer or bool tensor, got {dtype}; use SUM, MIN or MAX")
    if op_type == ReduceOp.AVG and dtype == torch.bool:
        raise ValueError("ReduceOp.AVG is undefined for bool tensors; use BOR (any) or BAND (all)")
    if op_type in (ReduceOp.MIN, ReduceOp.MAX) and dtype.is_complex:
        raise ValueError(
            f"ReduceOp.{op_type.name} is undefined for complex dtype {dtype}; reduce real and imaginary parts"
        )
    _valid.add(key)
    return op_type


def reduce_into(acc: torch.Tensor, other: torch.Tensor, op: RedOpType) -> None:
    """Combine ``other`` into ``acc`` in place: ``acc = acc op other`` (AVG adds; :func:`finish` divides).

    Args:
        acc: accumulator, overwritten.
        other: tensor of the same shape and dtype, read only.
        op: an operator already validated by :func:`check`.
    """
    combine(acc, other, op, out=acc)


def combine(first: torch.Tensor, second: torch.Tensor, op: RedOpType, out: torch.Tensor) -> None:
    """Write ``first op second`` into ``out`` without allocating (``out`` may alias either input).

    The operand order is explicit so that two ranks combining the same two
    tensors get the same bits even where an operator is not bitwise symmetric
    (MIN/MAX of ``-0.0`` and ``+0.0``).

    Args:
        first: left operand.
        second: right operand, same shape and dtype.
        op: an operator already validated by :func:`check`.
        out: destination, same shape and dtype.
    """
    if op == ReduceOp.SUM or op == ReduceOp.AVG:
        torch.add(first, second, out=out)
    elif op == ReduceOp.PRODUCT:
        torch.mul(first, second, out=out)
    elif op == ReduceOp.MIN:
        torch.minimum(first, second, out=out)
    elif op == ReduceOp.MAX:
        torch.maximum(first, second, out=out)
    elif op == ReduceOp.BAND:
        torch.bitwise_and(first, second, out=out)
    elif op == ReduceOp.BOR:
        torch.bitwise_or(first, second, out=out)
    elif op == ReduceOp.BXOR:
        torch.bitwise_xor(first, second, out=out)
    else:  # check() let through an operator this function does not know
        raise AssertionError(f"unhandled reduce op {op}")


def finish(tensor: torch.Tensor, op: RedOpType, world_size: int) -> None:
    """Turn a reduced tensor into the operator's result in place (AVG: divide by ``world_size``).

    Args:
        tensor: the fully reduced tensor.
        op: an operator already validated by :func:`check`.
        world_size: number of ranks whose values were reduced.
    """
    if op != ReduceOp.AVG or world_size == 1:
        return
    if tensor.dtype.is_floating_point or tensor.dtype.is_complex:
        divide(tensor, world_size)
    else:
        tensor.div_(world_size, rounding_mode="trunc")


def divide(tensor: torch.Tensor, divisor: int) -> None:
    """``tensor /= divisor`` in place, for a floating-point tensor, with the bits of ``div_``.

    By a power of two it multiplies by the inverse instead: the same correctly
    rounded result (the inverse is exact), at half the cost of a division on
    the CPU.
    """
    if divisor & (divisor - 1) == 0:
        tensor.mul_(1.0 / divisor)
    else:
        tensor.div_(divisor)


def run_all_reduce(
    tensor: torch.Tensor, op: Op, group: dist.ProcessGroup | None, algorithm: AllReduceAlgorithm
) -> None:
    """Reduce ``tensor`` in place with ``algorithm``, around it the steps every all_reduce shares.

    Checks ``op``; returns at once on a rank outside ``group`` (as
    ``torch.distributed`` does); with more than one rank, calls
    ``algorithm(flat, op, rank, world_size, group)`` on a flat contiguous view
    of ``tensor`` (copied back if ``tensor`` is not contiguous); then
    :func:`finish` (AVG divides by the group size).

    Args:
        tensor: input and output; every rank passes the same number of elements and dtype.
        op: reduction operator.
        group: process group, or None for the world group.
        algorithm: the exchange; it gets ``op`` already checked and ranks of ``group``, and
            leaves the operator's unfinished result (AVG: the sum) in ``flat`` on every rank.

    Raises:
        ValueError: ``op`` is not supported for ``tensor``'s dtype.
    """
    op = check(op, tensor.dtype)
    rank, world_size = p2p.rank_and_world_size(group)
    if rank < 0:  # not a member of group: nothing to do, as in torch.distributed
        return
    if world_size > 1:
        with chunks.flat_view(tensor) as flat:
            algorithm(flat, op, rank, world_size, group)
    finish(tensor, op, world_size)
