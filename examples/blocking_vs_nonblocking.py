"""Blocking versus non-blocking point-to-point: swap a tensor between two ranks.

Run either way:

    python examples/blocking_vs_nonblocking.py               # spawns 2 ranks itself
    torchrun --nproc-per-node 2 examples/blocking_vs_nonblocking.py

Blocking (``dist.send`` / ``dist.recv``): a call returns only when its
transfer is done. If both ranks called ``send`` first, each would wait for a
receive the other never reaches: a deadlock (gloo's send waits for the
matching receive). So the ranks take opposite orders, even ranks send first,
odd ranks receive first, and the two directions run one after the other::

    rank 0:  send ======>  recv <======
    rank 1:  recv <======  send ======>

Non-blocking (``dist.isend`` / ``dist.irecv``): both calls return at once
with a request; both directions move at the same time, the rank is free to
compute meanwhile, and ``wait()`` marks the point where the data is needed.
Until then the send buffer must not change and the receive buffer must not
be read::

    rank 0:  irecv + isend ==> compute ... wait
    rank 1:  irecv + isend ==> compute ... wait

The script times both versions on 16 MiB, with the same computation after
the exchange (blocking) or during it (non-blocking). How much overlap gains
depends on spare cores: on a 2-core host the two transfers and the
computation compete for the same cores, and the gain can be small.
"""

import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

NUM_BYTES = 16 * 2**20
NUM_REPEATS = 5


def compute() -> None:
    """Some work that does not need the incoming data, e.g. the next layer's gradients."""
    a = torch.ones(256, 256)
    for _ in range(4):
        a = a @ a / 256


def blocking_swap(outgoing: torch.Tensor, incoming: torch.Tensor, peer: int, rank: int) -> None:
    if rank % 2 == 0:  # opposite orders on the two ranks: no deadlock
        dist.send(outgoing, dst=peer)
        dist.recv(incoming, src=peer)
    else:
        dist.recv(incoming, src=peer)
        dist.send(outgoing, dst=peer)
    compute()


def nonblocking_swap(outgoing: torch.Tensor, incoming: torch.Tensor, peer: int, rank: int) -> None:
    # Same order on both ranks is fine: neither call waits.
    requests = [dist.irecv(incoming, src=peer), dist.isend(outgoing, dst=peer)]
    compute()  # overlaps with the transfers
    for request in requests:
        request.wait()


def main(rank: int, world_size: int) -> None:
    if world_size != 2:
        raise ValueError(f"this example needs exactly 2 ranks, got {world_size}; use --nproc-per-node 2")
    torch.set_num_threads(1)  # the two ranks share this machine's cores
    peer = 1 - rank
    outgoing = torch.full((NUM_BYTES // 4,), float(rank))
    incoming = torch.empty_like(outgoing)
    for name, swap in (("blocking", blocking_swap), ("non-blocking", nonblocking_swap)):
        times = []
        for _ in range(NUM_REPEATS + 1):  # the first run warms up
            incoming.fill_(-1)
            dist.barrier()
            start = time.perf_counter()
            swap(outgoing, incoming, peer, rank)
            times.append(time.perf_counter() - start)
        assert torch.all(incoming == peer), "the swap delivered the wrong data"
        if rank == 0:
            median_ms = statistics.median(times[1:]) * 1e3
            print(f"{name:>12}: swap {NUM_BYTES >> 20} MiB + compute, median {median_ms:.1f} ms", flush=True)


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
