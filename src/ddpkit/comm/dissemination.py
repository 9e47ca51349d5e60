"""Dissemination barrier: no rank leaves before every rank has arrived.

In round ``k`` rank ``r`` signals rank ``(r + 2^k) % n`` and waits for the
signal of rank ``(r - 2^k) % n``. After round ``k`` a rank has heard, directly
or through others, from the ``2^(k+1) - 1`` ranks before it, so after
``ceil(log2 n)`` rounds it has heard from all::

    n = 4      round 0 (+1)     round 1 (+2)
    rank 0 ->  1                2
    rank 1 ->  2                3
    rank 2 ->  3                0
    rank 3 ->  0                1

Cost: ``ceil(log2 n)`` steps of one byte each way per rank; unlike a
gather-then-release through a root, no rank handles more than one message
per round.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ddpkit.comm import p2p


def barrier(group: dist.ProcessGroup | None = None) -> None:
    """Block until every rank of ``group`` has called ``barrier``.

    Args:
        group: process group, or None for the world group.
    """
    rank, n = p2p.rank_and_world_size(group)
    if rank < 0:  # not a member of group: nothing to do, as in torch.distributed
        return
    # The token must not be empty: empty messages are not sent at all.
    token = torch.zeros(1, dtype=torch.uint8)
    arrived = torch.empty(1, dtype=torch.uint8)
    distance = 1
    while distance < n:
        p2p.exchange(token, (rank + distance) % n, arrived, (rank - distance) % n, group)
        distance *= 2
