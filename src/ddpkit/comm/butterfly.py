"""Butterfly all_reduce: recursive halving (reduce-scatter) then recursive doubling (all-gather).

Also known as Rabenseifner's algorithm. For ``p`` a power of two, ranks pair
up across the bit ``p/2``, then ``p/4``, ... 1. At each step of the halving
phase a rank keeps half of its current range of chunks, sends the other
half to its partner, and reduces the partner's copy of the half it kept.
After ``log2 p`` steps rank ``v`` owns chunk ``v`` fully reduced. The
doubling phase replays the steps backwards, swapping owned ranges until
every rank has everything.

p = 4, chunks a b c d; ``|`` separates what a rank keeps::

    halving, distance 2      halving, distance 1      doubling 1, 2
    rank 0 <-> 2: keeps ab   rank 0 <-> 1: keeps a    swap a<->b, then ab<->cd
    rank 1 <-> 3: keeps ab   rank 1 <-> 0: keeps b
    rank 2 <-> 0: keeps cd   rank 2 <-> 3: keeps c
    rank 3 <-> 1: keeps cd   rank 3 <-> 2: keeps d

Other world sizes: let ``p`` be the largest power of two <= ``n`` and
``extra = n - p``. Among ranks ``0 .. 2*extra - 1`` the even ranks first send
their whole tensor to the odd rank above, which reduces it, and then wait
while the other ``p`` ranks run the power-of-two algorithm; at the end each
odd rank sends the result back to its even neighbour::

    n = 3 (p = 2, extra = 1):   rank 0 --x0--> rank 1     fold
                                rank 1 <=====> rank 2     butterfly on 2 ranks
                                rank 0 <--sum- rank 1     unfold

Cost for a tensor of ``N`` bytes and ``n`` a power of two: ``2 log2 n`` steps;
sends and receives ``2 (n - 1) / n * N`` bytes each way, like the ring, in
far fewer steps, so it wins where latency dominates (small tensors, many
ranks). Otherwise the folded ranks add 2 steps and ``N`` bytes each way.
Chunks come from ``torch.tensor_split``, so a range of chunks is a contiguous
slice of any size.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ddpkit.comm import chunks, ops, p2p
from ddpkit.comm.ops import Op, RedOpType, ReduceOp


def all_reduce(tensor: torch.Tensor, op: Op = ReduceOp.SUM, group: dist.ProcessGroup | None = None) -> None:
    """Reduce ``tensor`` across all ranks of ``group`` in place, by recursive halving and doubling.

    Args:
        tensor: input and output; every rank passes the same number of elements and dtype.
        op: reduction operator (see :mod:`ddpkit.comm.ops`).
        group: process group, or None for the world group.

    Raises:
        ValueError: ``op`` is not supported for ``tensor``'s dtype.
    """
    ops.run_all_reduce(tensor, op, group, _butterfly)


def _butterfly(flat: torch.Tensor, op: RedOpType, rank: int, n: int, group: dist.ProcessGroup | None) -> None:
    p = 1 << (n.bit_length() - 1)  # largest power of two <= n
    extra = n - p
    scratch = chunks.workspace(flat.numel(), flat.dtype, flat.device)

    # Fold: ranks below 2 * extra pair up (even -> odd) so that p ranks remain.
    if rank < 2 * extra:
        if rank % 2 == 0:
            p2p.send(flat, rank + 1, group)
            p2p.recv(flat, rank + 1, group)  # unfold: the final result
            return
        p2p.recv(scratch, rank - 1, group)
        ops.reduce_into(flat, scratch, op)
        virtual = rank // 2
    else:
        virtual = rank - extra

    def real(v: int) -> int:
        return 2 * v + 1 if v < extra else v + extra

    bounds = chunks.offsets(flat.numel(), p)
    lo, hi = 0, p  # range of chunks this rank is responsible for
    distance = p // 2
    while distance >= 1:  # recursive halving: reduce-scatter
        partner = real(virtual ^ distance)
        mid = (lo + hi) // 2
        if virtual & distance:
            keep, give = (mid, hi), (lo, mid)
        else:
            keep, give = (lo, mid), (mid, hi)
        kept = flat[bounds[keep[0]] : bounds[keep[1]]]
        received = scratch[: kept.numel()]
        p2p.exchange(flat[bounds[give[0]] : bounds[give[1]]], partner, received, partner, group)
        ops.reduce_into(kept, received, op)
        lo, hi = keep
        distance //= 2

    distance = 1
    while distance < p:  # recursive doubling: all-gather
        partner = real(virtual ^ distance)
        size = hi - lo
        # The partner owns the neighbouring range of the same size.
        other = (lo + size, hi + size) if not virtual & distance else (lo - size, hi - size)
        p2p.exchange(flat[bounds[lo] : bounds[hi]], partner, flat[bounds[other[0]] : bounds[other[1]]], partner, group)
        lo, hi = min(lo, other[0]), max(hi, other[1])
        distance *= 2

    if rank < 2 * extra:  # unfold: give the result back to the even neighbour
        p2p.send(flat, rank - 1, group)
