"""Point-to-point plumbing shared by every collective: ranks, tags, isend/irecv/wait.

Every message a ddpkit collective moves goes through this module, so the rules
that keep ranks from deadlocking or mixing messages live in one place:

- Ranks are *group ranks* (0 <= rank < group size). They are translated to
  global ranks with ``dist.get_global_rank`` only here, because
  ``dist.isend``/``dist.irecv`` address peers by global rank.
- Receives are posted before sends, and both are non-blocking
  (``dist.irecv``/``dist.isend``) and waited together. A blocking ``send`` on
  both ends of a pair would deadlock once a message is larger than the
  transport buffers; posting both halves first never does, whatever order the
  two peers reach the exchange in.
- Empty tensors are not sent at all. Both peers know every chunk size (they
  compute it from the same ``torch.tensor_split``), so both skip the same
  message and nothing is left unmatched.
- Collectives tag their messages from :data:`COLLECTIVE_TAG` upwards, so a
  user's own point-to-point traffic (tags below it) cannot be matched with a
  collective's message.

::

    rank a                        rank b
    irecv(buf_a <- b) --+   +-- irecv(buf_b <- a)
    isend(x_a -> b) ----|---|-> lands in buf_b
                        +<--|-- isend(x_b -> a)
    wait(both)              wait(both)
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist

COLLECTIVE_TAG = 1 << 20
"""First tag used by ddpkit's collectives; keep your own point-to-point tags below it."""

Work = dist.Work


def rank_and_world_size(group: dist.ProcessGroup | None) -> tuple[int, int]:
    """Return this process's rank in ``group`` and the group's size.

    Args:
        group: a process group, or None for the default (world) group.

    Returns:
        ``(rank, world_size)``; rank is -1 when this process is not in ``group``.
    """
    return dist.get_rank(group), dist.get_world_size(group)


def check_group_rank(what: str, rank: int, world_size: int) -> None:
    """Check that a root rank a caller passed (``dst``, ``src``) is a rank of the group.

    Args:
        what: the collective and argument, as ``"gather dst"``, for the message.
        rank: the rank passed.
        world_size: the group's size.

    Raises:
        ValueError: ``rank`` is not in ``0 .. world_size - 1``.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"{what} rank {rank} is outside the group of {world_size} ranks; pass a group rank")


def global_rank(group: dist.ProcessGroup | None, group_rank: int) -> int:
    """Translate a rank of ``group`` to its global rank (identity for the world group)."""
    if group is None or group is dist.GroupMember.WORLD:
        return group_rank
    return dist.get_global_rank(group, group_rank)


def isend(
    tensor: torch.Tensor, dst: int, group: dist.ProcessGroup | None = None, tag: int = COLLECTIVE_TAG
) -> Work | None:
    """Start sending ``tensor`` to group rank ``dst``; None when there is nothing to send.

    Args:
        tensor: a contiguous tensor; it must not change until the send is waited.
        dst: destination rank in ``group``.
        group: process group, or None for the world group.
        tag: message tag, matched with the receiver's tag.

    Returns:
        The pending work, or None for an empty tensor (no message is sent).
    """
    if tensor.numel() == 0:
        return None
    return dist.isend(tensor, global_rank(group, dst), group=group, tag=tag)


def irecv(
    tensor: torch.Tensor, src: int, group: dist.ProcessGroup | None = None, tag: int = COLLECTIVE_TAG
) -> Work | None:
    """Start receiving into ``tensor`` from group rank ``src``; None when nothing is expected.

    Args:
        tensor: a contiguous tensor with the sender's number of elements and dtype.
        src: source rank in ``group``.
        group: process group, or None for the world group.
        tag: message tag, matched with the sender's tag.

    Returns:
        The pending work, or None for an empty tensor (no message is expected).
    """
    if tensor.numel() == 0:
        return None
    return dist.irecv(tensor, global_rank(group, src), group=group, tag=tag)


def wait_all(works: Iterable[Work | None]) -> None:
    """Wait for every pending send and receive (None entries are skipped)."""
    for work in works:
        if work is not None:
            work.wait()


def exchange(
    send_tensor: torch.Tensor | None,
    dst: int,
    recv_tensor: torch.Tensor | None,
    src: int,
    group: dist.ProcessGroup | None = None,
    tag: int = COLLECTIVE_TAG,
) -> None:
    """Send ``send_tensor`` to ``dst`` while receiving ``recv_tensor`` from ``src``; return when both are done.

    The receive is posted first and both halves are non-blocking, so two
    ranks exchanging with each other never deadlock.

    Args:
        send_tensor: what to send, or None to only receive.
        dst: destination rank in ``group`` (ignored when ``send_tensor`` is None).
        recv_tensor: where to receive, or None to only send.
        src: source rank in ``group`` (ignored when ``recv_tensor`` is None).
        group: process group, or None for the world group.
        tag: message tag for both directions.
    """
    recv_work = irecv(recv_tensor, src, group, tag) if recv_tensor is not None else None
    send_work = isend(send_tensor, dst, group, tag) if send_tensor is not None else None
    wait_all((recv_work, send_work))


def send(tensor: torch.Tensor, dst: int, group: dist.ProcessGroup | None = None, tag: int = COLLECTIVE_TAG) -> None:
    """Send ``tensor`` to group rank ``dst`` and wait until it is sent."""
    exchange(tensor, dst, None, -1, group, tag)


def recv(tensor: torch.Tensor, src: int, group: dist.ProcessGroup | None = None, tag: int = COLLECTIVE_TAG) -> None:
    """Receive into ``tensor`` from group rank ``src`` and wait until it has arrived."""
    exchange(None, -1, tensor, src, group, tag)
