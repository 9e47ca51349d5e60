"""Ordered printing: every rank prints in rank order, one after the other, using barriers.

Run either way:

    python examples/ordered_print.py [NUM_RANKS]             # spawns NUM_RANKS (default 2) itself
    torchrun --nproc-per-node 4 examples/ordered_print.py

Processes print whenever the scheduler lets them; nothing orders their lines.
To print in rank order, take turns: in turn ``r`` only rank ``r`` prints,
then everybody meets at a barrier before the next turn. ``flush=True``
matters: the line must be out of this process's buffer before the barrier
lets the next rank print. The barrier is ddpkit's (built on point-to-point
messages only, see ``ddpkit/comm/dissemination.py``); ``dist.barrier()``
works the same way.
"""

import os
import sys
import tempfile

import torch.distributed as dist
import torch.multiprocessing as mp

from ddpkit.comm import barrier


def main(rank: int, world_size: int) -> None:
    for turn in range(world_size):
        if turn == rank:
            print(f"rank {rank} of {world_size}: my turn ({turn})", flush=True)
        barrier()
    # The same in reverse order: only the turn order changes.
    for turn in reversed(range(world_size)):
        if turn == rank:
            print(f"rank {rank} of {world_size}: my turn in reverse", flush=True)
        barrier()


# Launching: under torchrun the environment names the rank; otherwise spawn the ranks
# that meet through a file in a temporary folder (no port to choose).


def _spawned(rank: int, world_size: int, store_path: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world_size)
    try:
        main(rank, world_size)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    if "RANK" in os.environ:  # started by torchrun
        dist.init_process_group("gloo")
        main(dist.get_rank(), dist.get_world_size())
        dist.destroy_process_group()
        sys.exit(0)
    num_ranks = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    with tempfile.TemporaryDirectory() as folder:
        mp.spawn(_spawned, args=(num_ranks, os.path.join(folder, "store")), nprocs=num_ranks)
