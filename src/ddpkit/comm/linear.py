"""Linear gather and scatter: the root exchanges one message directly with every rank.

gather: every rank sends its tensor straight to the destination, which posts
one receive per rank at once (messages land in whatever order they arrive)::

    rank 1 --x1--+
    rank 2 --x2--+--> rank 0: gather_list = [x0, x1, x2, x3]
    rank 3 --x3--+

scatter: the mirror image; the source sends rank ``i`` its ``scatter_list[i]``::

                                      +--s1--> rank 1
    rank 0: scatter_list = [s0 .. s3] +--s2--> rank 2
                                      +--s3--> rank 3

Cost for tensors of ``N`` bytes: one step; the root receives (gather) or
sends (scatter) ``(n - 1) N`` bytes, every other rank sends or receives
``N``. A tree would not lower the root's ``(n - 1) N`` bytes, only add steps.
"""

from __future__ import annotations

from contextlib import ExitStack

import torch
import torch.distributed as dist

from ddpkit.comm import chunks, p2p


def gather(
    tensor: torch.Tensor,
    gather_list: list[torch.Tensor] | None = None,
    dst: int = 0,
    group: dist.ProcessGroup | None = None,
) -> None:
    """Gather ``tensor`` from every rank into ``gather_list`` on rank ``dst``.

    Args:
        tensor: this rank's contribution; same number of elements and dtype on every rank.
        gather_list: on ``dst``, one output tensor per rank; ignored elsewhere.
        dst: destination rank in ``group`` (a group rank, not a global rank).
        group: process group, or None for the world group.

    Raises:
        ValueError: ``dst`` is outside the group, or ``gather_list`` on ``dst`` does not fit.
    """
    rank, world_size = p2p.rank_and_world_size(group)
    if rank < 0:  # not a member of group: nothing to do, as in torch.distributed
        return
    p2p.check_group_rank("gather dst", dst, world_size)
    if rank != dst:
        p2p.send(tensor.contiguous(), dst, group)
        return
    if gather_list is None or len(gather_list) != world_size:
        got = "None" if gather_list is None else f"{len(gather_list)} tensors"
        raise ValueError(
            f"gather on dst rank {dst} needs gather_list with one tensor per rank ({world_size}), got {got}"
        )
    for i, t in enumerate(gather_list):
        if t.numel() != tensor.numel() or t.dtype != tensor.dtype:
            raise ValueError(
                f"gather_list[{i}] is {tuple(t.shape)} {t.dtype} but the input is {tuple(tensor.shape)} "
                f"{tensor.dtype}; every output must match the input's size and dtype"
            )
    with ExitStack() as stack:
        outputs = [stack.enter_context(chunks.flat_view(t)) for t in gather_list]
        works = [p2p.irecv(outputs[src], src, group) for src in range(world_size) if src != dst]
        outputs[dst].copy_(tensor.reshape(-1))
        p2p.wait_all(works)


def scatter(
    tensor: torch.Tensor,
    scatter_list: list[torch.Tensor] | None = None,
    src: int = 0,
    group: dist.ProcessGroup | None = None,
) -> None:
    """Send ``scatter_list[i]`` of rank ``src`` into ``tensor`` of rank ``i``.

    Args:
        tensor: this rank's output.
        scatter_list: on ``src``, one tensor per rank, each with ``tensor``'s size and dtype; ignored elsewhere.
        src: source rank in ``group`` (a group rank, not a global rank).
        group: process group, or None for the world group.

    Raises:
        ValueError: ``src`` is outside the group, or ``scatter_list`` on ``src`` does not fit.
    """
    rank, world_size = p2p.rank_and_world_size(group)
    if rank < 0:  # not a member of group: nothing to do, as in torch.distributed
        return
    p2p.check_group_rank("scatter src", src, world_size)
    if rank != src:
        with chunks.flat_view(tensor) as flat:
            p2p.recv(flat, src, group)
        return
    if scatter_list is None or len(scatter_list) != world_size:
        got = "None" if scatter_list is None else f"{len(scatter_list)} tensors"
        raise ValueError(
            f"scatter on src rank {src} needs scatter_list with one tensor per rank ({world_size}), got {got}"
        )
    for i, t in enumerate(scatter_list):
        if t.numel() != tensor.numel() or t.dtype != tensor.dtype:
            raise ValueError(
                f"scatter_list[{i}] is {tuple(t.shape)} {t.dtype} but the output is {tuple(tensor.shape)} "
                f"{tensor.dtype}; every input must match the output's size and dtype"
            )
    # .contiguous() keeps a reference to any copy until the sends are waited.
    outgoing = [t.contiguous() for t in scatter_list]
    works = [p2p.isend(outgoing[dst], dst, group) for dst in range(world_size) if dst != src]
    tensor.copy_(scatter_list[src].reshape(tensor.shape))
    p2p.wait_all(works)
