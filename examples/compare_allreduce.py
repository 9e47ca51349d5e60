"""Time ddpkit's all_reduce algorithms against gloo's built-in, side by side.

Run either way:

    python examples/compare_allreduce.py                      # spawns 2 ranks itself
    python examples/compare_allreduce.py --sizes-mib 1 4 16 32 --algorithms ring butterfly --repeats 10
    torchrun --nproc-per-node 4 examples/compare_allreduce.py

Every algorithm is looked up by name (``ddpkit.comm.resolve_allreduce``) and
timed interleaved with the built-in on the same float32 tensor, so a noisy,
shared machine slows both alike: the ratio is what to read. A timing is the
slowest rank's, after a barrier, following nccl-tests; the table shows the
median (min-max) of the repeats after warm-up, the ratio of the medians to
``builtin``, and the paired ratio: the median over repeats of this
algorithm's time divided by the built-in's in the same repeat, which load
swings on a shared host disturb least.
"""

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ddpkit.comm import available_allreduce_algorithms, resolve_allreduce


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mib", type=float, nargs="+", default=[1, 4, 16, 32])
    parser.add_argument("--algorithms", nargs="+", default=["ring"], help="names from ddpkit.comm.ALLREDUCE_ALGORITHMS")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--nproc", type=int, default=2, help="ranks to spawn when not under torchrun")
    return parser.parse_args(argv)


def main(rank: int, world_size: int, args: argparse.Namespace) -> None:
    torch.set_num_threads(1)  # the ranks share this machine's cores
    names = ["builtin", *[a for a in args.algorithms if a != "builtin"]]
    functions = {name: resolve_allreduce(name) for name in names}
    if rank == 0:
        print(
            f"{world_size} ranks, float32, slowest rank, median (min-max) of {args.repeats}; "
            f"available: {', '.join(available_allreduce_algorithms())}"
        )
    for size_mib in args.sizes_mib:
        tensor = torch.randn(max(1, int(size_mib * 2**20) // 4))
        times: dict[str, list[float]] = {name: [] for name in names}
        for repeat in range(args.warmup + args.repeats):
            for name, fn in functions.items():  # interleaved: noise hits every algorithm alike
                dist.barrier()
                start = time.perf_counter()
                fn(tensor)
                elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
                if repeat >= args.warmup:
                    times[name].append(elapsed.item())
        if rank == 0:
            base = statistics.median(times["builtin"])
            cells = [
                f"{name} {statistics.median(t) * 1e3:.2f} ({min(t) * 1e3:.2f}-{max(t) * 1e3:.2f}) ms"
                + (
                    ""
                    if name == "builtin"
                    else f" x{statistics.median(t) / base:.2f}"
                    f" paired x{statistics.median(a / b for a, b in zip(t, times['builtin'])):.2f}"
                )
                for name, t in times.items()
            ]
            print(f"{size_mib:g} MiB: " + " | ".join(cells), flush=True)


# Launching: under torchrun the environment names the rank; otherwise spawn the ranks
# that meet through a file in a temporary folder (no port to choose).


def _spawned(rank: int, world_size: int, store_path: str, args: argparse.Namespace) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world_size)
    try:
        main(rank, world_size, args)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    arguments = parse_args(sys.argv[1:])
    if "RANK" in os.environ:  # started by torchrun
        dist.init_process_group("gloo")
        main(dist.get_rank(), dist.get_world_size(), arguments)
        dist.destroy_process_group()
        sys.exit(0)
    with tempfile.TemporaryDirectory() as folder:
        mp.spawn(_spawned, args=(arguments.nproc, os.path.join(folder, "store"), arguments), nprocs=arguments.nproc)
