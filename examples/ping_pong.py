"""Ping-pong: two ranks pass a counter back and forth, in a strict order.

Run either way:

    python examples/ping_pong.py                             # spawns 2 ranks itself
    torchrun --nproc-per-node 2 examples/ping_pong.py

Rank 0 sends the ball (a counter), rank 1 receives it, adds one and sends it
back, and so on. ``dist.send`` and ``dist.recv`` block, and each rank prints
*before* it sends, so the lines come out in order although two processes
write them. Afterwards, the two ranks time 200 round trips of a 4-byte
message: half a round trip is the point-to-point latency (as OSU's
benchmark reports it).
"""

import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

NUM_HITS = 6
NUM_TIMED_ROUND_TRIPS = 200


def main(rank: int, world_size: int) -> None:
    if world_size != 2:
        raise ValueError(f"ping-pong needs exactly 2 ranks, got {world_size}; use --nproc-per-node 2")
    peer = 1 - rank
    ball = torch.zeros(1, dtype=torch.int64)
    # Rank 0 serves: it "receives" the ball from nobody and hits it first.
    for hit in range(rank, NUM_HITS, 2):
        if hit > 0:
            dist.recv(ball, src=peer)
        ball += 1
        print(f"rank {rank} {'ping' if rank == 0 else 'pong'}: ball = {ball.item()}", flush=True)
        if hit + 1 < NUM_HITS:
            dist.send(ball, dst=peer)

    # Latency: time round trips of a tiny message, after a few warm-up ones.
    message = torch.zeros(1, dtype=torch.float32)
    for i in range(NUM_TIMED_ROUND_TRIPS + 10):
        if i == 10:
            start = time.perf_counter()
        if rank == 0:
            dist.send(message, dst=peer)
            dist.recv(message, src=peer)
        else:
            dist.recv(message, src=peer)
            dist.send(message, dst=peer)
    if rank == 0:
        half_round_trip = (time.perf_counter() - start) / NUM_TIMED_ROUND_TRIPS / 2
        print(f"latency (half round trip, 4 bytes, {dist.get_backend()}): {half_round_trip * 1e6:.0f} us")


# Launching: under torchrun the environment names the rank; otherwise spawn 2 ranks
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
    with tempfile.TemporaryDirectory() as folder:
        mp.spawn(_spawned, args=(2, os.path.join(folder, "store")), nprocs=2)
