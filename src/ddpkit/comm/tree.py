"""Binary-tree collectives: reduce up a tree, broadcast down it, all_reduce = both.

Ranks are laid out as a binary heap rooted at the root rank: with
``v = (rank - root) % n``, rank ``v``'s children are ``2v + 1`` and ``2v + 2``
and its parent is ``(v - 1) // 2`` (shifted back by ``root``)::

                 0                 reduce: values flow up, each rank
               /   \\               reduces its children's into its own
              1     2
             / \\   / \\            broadcast: the result flows down,
            3   4 5   6            each rank forwards it to its children

The tensor is cut into segments of about ``chunks.SEGMENT_BYTES``; a rank
forwards segment ``j`` as soon as it has it (reduced, for ``reduce``), so the
levels work at the same time on different segments, as in NCCL's trees.

Cost for a tensor of ``N`` bytes: ``ceil(log2(n + 1)) - 1`` levels. In
``reduce`` an inner rank receives ``2 N``, reduces ``2 N`` and sends ``N``;
a leaf only sends ``N``. ``broadcast`` is the mirror image (an inner rank
receives ``N`` and sends ``2 N``). ``all_reduce`` is ``reduce`` to rank 0
then ``broadcast`` from it: ``2 (ceil(log2(n + 1)) - 1)`` levels, and an inner
rank moves ``3 N`` each way, more than the ring's ``2 (n - 1) / n * N``, in
fewer, pipelined steps.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ddpkit.comm import chunks, ops, p2p
from ddpkit.comm.ops import Op, RedOpType, ReduceOp


def _neighbours(rank: int, root: int, n: int) -> tuple[int | None, list[int]]:
    """Parent (None at the root) and children of ``rank`` in the heap rooted at ``root``."""
    v = (rank - root) % n
    parent = None if v == 0 else ((v - 1) // 2 + root) % n
    children = [(c + root) % n for c in (2 * v + 1, 2 * v + 2) if c < n]
    return parent, children


def reduce(tensor: torch.Tensor, dst: int, op: Op = ReduceOp.SUM, group: dist.ProcessGroup | None = None) -> None:
    """Reduce ``tensor`` from all ranks into ``tensor`` of rank ``dst``, up a binary tree.

    On other ranks ``tensor`` is left holding a partial result (unspecified, as
    in ``torch.distributed.reduce``).

    Args:
        tensor: input, and the output on ``dst``; same number of elements and dtype on every rank.
        dst: destination rank in ``group`` (a group rank, not a global rank).
        op: reduction operator (see :mod:`ddpkit.comm.ops`).
        group: process group, or None for the world group.

    Raises:
        ValueError: ``dst`` is not a rank of the group, or ``op`` is unsupported for the dtype.
    """
    op = ops.check(op, tensor.dtype)
    rank, world_size = p2p.rank_and_world_size(group)
    if rank < 0:  # not a member of group: nothing to do, as in torch.distributed
        return
    p2p.check_group_rank("reduce dst", dst, world_size)
    with chunks.flat_view(tensor) as flat:
        _reduce(flat, dst, op, rank, world_size, group)
    if rank == dst:
        ops.finish(tensor, op, world_size)


def _reduce(flat: torch.Tensor, root: int, op: RedOpType, rank: int, n: int, group: dist.ProcessGroup | None) -> None:
    parent, children = _neighbours(rank, root, n)
    segs = chunks.segments(flat)
    scratch = chunks.workspace(len(children) * flat.numel(), flat.dtype, flat.device)
    # Post every receive first: both children stream all their segments at once.
    received = []
    for i, child in enumerate(children):
        landing = chunks.segments(scratch[i * flat.numel() : (i + 1) * flat.numel()])
        received.append([(seg, p2p.irecv(seg, child, group, p2p.COLLECTIVE_TAG + j)) for j, seg in enumerate(landing)])
    sends = []
    for j, seg in enumerate(segs):
        for child_segments in received:  # children in heap order: a fixed reduction order
            landed, work = child_segments[j]
            p2p.wait_all((work,))
            ops.reduce_into(seg, landed, op)
        if parent is not None:
            sends.append(p2p.isend(seg, parent, group, p2p.COLLECTIVE_TAG + j))
    p2p.wait_all(sends)


def broadcast(tensor: torch.Tensor, src: int, group: dist.ProcessGroup | None = None) -> None:
    """Copy ``tensor`` of rank ``src`` into ``tensor`` of every rank, down a binary tree.

    Args:
        tensor: the data on ``src``, the output elsewhere; same number of elements and dtype on every rank.
        src: source rank in ``group`` (a group rank, not a global rank).
        group: process group, or None for the world group.

    Raises:
        ValueError: ``src`` is not a rank of the group.
    """
    rank, world_size = p2p.rank_and_world_size(group)
    if rank < 0:
        return
    p2p.check_group_rank("broadcast src", src, world_size)
    with chunks.flat_view(tensor) as flat:
        _broadcast(flat, src, rank, world_size, group)


def _broadcast(flat: torch.Tensor, root: int, rank: int, n: int, group: dist.ProcessGroup | None) -> None:
    parent, children = _neighbours(rank, root, n)
    segs = chunks.segments(flat)
    tag = p2p.COLLECTIVE_TAG
    arrivals = [p2p.irecv(seg, parent, group, tag + j) if parent is not None else None for j, seg in enumerate(segs)]
    sends: list[p2p.Work | None] = []
    for j, seg in enumerate(segs):
        p2p.wait_all((arrivals[j],))
        sends.extend(p2p.isend(seg, child, group, tag + j) for child in children)
    p2p.wait_all(sends)


def all_reduce(tensor: torch.Tensor, op: Op = ReduceOp.SUM, group: dist.ProcessGroup | None = None) -> None:
    """Reduce ``tensor`` across all ranks of ``group`` in place: tree reduce to rank 0, then tree broadcast.

    Args:
        tensor: input and output; every rank passes the same number of elements and dtype.
        op: reduction operator (see :mod:`ddpkit.comm.ops`).
        group: process group, or None for the world group.

    Raises:
        ValueError: ``op`` is not supported for ``tensor``'s dtype.
    """
    ops.run_all_reduce(tensor, op, group, _reduce_then_broadcast)


def _reduce_then_broadcast(
    flat: torch.Tensor, op: RedOpType, rank: int, n: int, group: dist.ProcessGroup | None
) -> None:
    _reduce(flat, 0, op, rank, n, group)
    _broadcast(flat, 0, rank, n, group)
