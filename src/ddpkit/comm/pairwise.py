"""Pairwise all_to_all: every rank sends piece ``j`` of its input to rank ``j``.

Rank ``r`` receives from ``r - 1, r - 2, ...`` and sends to ``r + 1, r + 2, ...``
(mod ``n``): at shift ``s`` every rank talks to a different peer, so no rank
is flooded by all the others at once. Every receive is posted before any
send, so all ``n - 1`` transfers proceed together::

             send to          piece received from
    rank 0   1 2 3            3 2 1
    rank 1   2 3 0            0 3 2       input [a b c d] on rank r:
    rank 2   3 0 1            1 0 3       output[j] on rank r = input[r] of rank j
    rank 3   0 1 2            2 1 0

Cost with pieces of ``M`` bytes: one step (``n - 1`` concurrent messages);
every rank sends and receives ``(n - 1) M`` bytes, the minimum.
"""

from __future__ import annotations

from contextlib import ExitStack

import torch
import torch.distributed as dist

from ddpkit.comm import chunks, p2p


def all_to_all(
    output_tensor_list: list[torch.Tensor],
    input_tensor_list: list[torch.Tensor],
    group: dist.ProcessGroup | None = None,
) -> None:
    """Send ``input_tensor_list[j]`` to rank ``j``; receive rank ``j``'s piece in ``output_tensor_list[j]``.

    Pieces may have different sizes, as long as each output matches the size
    its sender uses.

    Args:
        output_tensor_list: one output tensor per rank.
        input_tensor_list: one input tensor per rank.
        group: process group, or None for the world group.

    Raises:
        ValueError: either list does not have one tensor per rank.
    """
    rank, n = p2p.rank_and_world_size(group)
    if rank < 0:  # not a member of group: nothing to do, as in torch.distributed
        return
    if len(output_tensor_list) != n or len(input_tensor_list) != n:
        raise ValueError(
            f"all_to_all got {len(output_tensor_list)} outputs and {len(input_tensor_list)} inputs for a group "
            f"of {n} ranks; pass one of each per rank"
        )
    with ExitStack() as stack:
        outputs = [stack.enter_context(chunks.flat_view(t)) for t in output_tensor_list]
        inputs = [t.contiguous() for t in input_tensor_list]
        recvs = [p2p.irecv(outputs[(rank - s) % n], (rank - s) % n, group) for s in range(1, n)]
        sends = [p2p.isend(inputs[(rank + s) % n], (rank + s) % n, group) for s in range(1, n)]
        outputs[rank].copy_(inputs[rank].reshape(-1))
        p2p.wait_all(recvs + sends)


def all_to_all_single(
    output: torch.Tensor,
    input: torch.Tensor,
    output_split_sizes: list[int] | None = None,
    input_split_sizes: list[int] | None = None,
    group: dist.ProcessGroup | None = None,
) -> None:
    """:func:`all_to_all` on two tensors split along dimension 0.

    Args:
        output: received pieces, concatenated along dim 0 in rank order.
        input: pieces to send, concatenated along dim 0 in rank order.
        output_split_sizes: dim-0 size of each received piece; None for equal pieces.
        input_split_sizes: dim-0 size of each sent piece; None for equal pieces.
        group: process group, or None for the world group.

    Raises:
        ValueError: split sizes do not add up to dim 0, or dim 0 does not divide evenly.
    """
    rank, n = p2p.rank_and_world_size(group)
    if rank < 0:
        return
    with chunks.flat_view(output) as flat:
        outputs = _split(flat.view(output.shape), output_split_sizes, n, "output")
        all_to_all(list(outputs), list(_split(input, input_split_sizes, n, "input")), group)


def _split(tensor: torch.Tensor, split_sizes: list[int] | None, n: int, name: str) -> tuple[torch.Tensor, ...]:
    if tensor.dim() == 0:
        raise ValueError(f"all_to_all_single {name} is a 0-d tensor; pass a tensor with a dimension 0 to split")
    rows = tensor.shape[0]
    if split_sizes is None:
        if rows % n:
            raise ValueError(
                f"all_to_all_single {name} has {rows} rows, not divisible by {n} ranks; pass {name}_split_sizes"
            )
        split_sizes = [rows // n] * n
    if len(split_sizes) != n or sum(split_sizes) != rows:
        raise ValueError(
            f"all_to_all_single {name}_split_sizes {list(split_sizes)} must have {n} entries adding up to "
            f"{name}.shape[0] = {rows}"
        )
    return torch.split(tensor, list(split_sizes), dim=0)
