"""Naive all_reduce through a root: everyone sends to rank 0, rank 0 reduces and sends back.

The textbook first attempt, kept as the baseline the other algorithms beat::

    rank 1 --x1--> +--------------+ --sum--> rank 1
    rank 2 --x2--> |    rank 0    | --sum--> rank 2
    rank 3 --x3--> | x0+x1+x2+x3  | --sum--> rank 3
                   +--------------+

Rank 0 receives the ranks' tensors one after the other, in rank order, and
reduces each into its own; then it sends the result to every other rank.

Cost for a tensor of ``N`` bytes: ``2 (n - 1)`` steps, all at the root. The
root receives ``(n - 1) N`` and sends ``(n - 1) N`` bytes and reduces
``(n - 1) N``; every other rank sends ``N`` and receives ``N``. The root's
link and CPU are the bottleneck, so time grows linearly with ``n``, where the
ring's stays nearly flat.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ddpkit.comm import chunks, ops, p2p
from ddpkit.comm.ops import Op, RedOpType, ReduceOp

ROOT = 0
"""Group rank that gathers, reduces and redistributes."""


def all_reduce(tensor: torch.Tensor, op: Op = ReduceOp.SUM, group: dist.ProcessGroup | None = None) -> None:
    """Reduce ``tensor`` across all ranks of ``group`` in place, through rank 0.

    Args:
        tensor: input and output; every rank passes the same number of elements and dtype.
        op: reduction operator (see :mod:`ddpkit.comm.ops`).
        group: process group, or None for the world group.

    Raises:
        ValueError: ``op`` is not supported for ``tensor``'s dtype.
    """
    ops.run_all_reduce(tensor, op, group, _through_root)


def _through_root(flat: torch.Tensor, op: RedOpType, rank: int, n: int, group: dist.ProcessGroup | None) -> None:
    """Everyone sends to ROOT, ROOT reduces in rank order and sends the result back."""
    if rank == ROOT:
        received = chunks.workspace(flat.numel(), flat.dtype, flat.device)
        for src in range(n):
            if src != ROOT:
                p2p.recv(received, src, group)
                ops.reduce_into(flat, received, op)
        p2p.wait_all([p2p.isend(flat, dst, group) for dst in range(n) if dst != ROOT])
    else:
        p2p.send(flat, ROOT, group)
        p2p.recv(flat, ROOT, group)
