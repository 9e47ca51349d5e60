"""Rank 1 fails in a function of this script after a line of output; rank 0 waits for it in a barrier."""

import torch.distributed as dist

import ddpkit


def labels_for(rank: int) -> list[int]:
    """Rank 1's labels are missing."""
    if rank == 1:
        raise KeyError(f"rank {rank} has no labels")
    return [0, 1]


if __name__ == "__main__":
    ctx = ddpkit.init()
    print(f"rank {ctx.rank} starts", flush=True)
    labels_for(ctx.rank)
    dist.barrier()
