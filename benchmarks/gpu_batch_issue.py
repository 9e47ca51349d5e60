"""What handing out a batch costs the loop's thread on a GPU, and whether its copy overlaps the step.

    python benchmarks/gpu_batch_issue.py                 # on a GPU
    python benchmarks/gpu_batch_issue.py --device cpu    # the same loop on the CPU (nothing placed)

One process (``ddpkit.init()`` alone), ``ddpkit.DataLoader`` over a
TensorDataset of 16 MiB batches (64 x 1024 x 64 float32), read two ways:

- ``tensor-dataset``: ``num_workers=0``, the TensorDataset fast path: the
  batch is indexed and pinned on the loop's thread, then copied on the
  loader's side stream;
- ``workers``: ``num_workers=2``: the workers index, torch's pinning thread
  pins, the loop's thread only issues the copy.

Each step is a GPU kernel of ``--step-ms`` (``torch.cuda._sleep``), queued
before the next batch is taken, as a training loop queues its step, and
waited for after it (as a loop that reads its loss each step waits), so that
the loop's thread never runs ahead of the GPU and an overlap is real. For every
batch after the first ``--warmup``, it reports how long ``next()`` held the
loop's thread and, on a GPU, whether the copy of the batch taken during step
n ended before step n did (the overlap the loader promises): medians and
maxima, one JSON line per source. An issue that takes longer than a step
leaves the GPU idle; a copy that ends after its step ran behind it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
from torch.utils.data import TensorDataset

import ddpkit
from ddpkit.bench import gpu_sleep

SOURCES = {"tensor-dataset": 0, "workers": 2}
"""Each source and its loader workers."""


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--batches", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5, help="batches not counted (the allocators' first blocks)")
    parser.add_argument("--step-ms", type=float, default=20.0, help="the GPU time of each step")
    return parser.parse_args()


def measure(source: str, args: argparse.Namespace, cycles_per_ms: float) -> dict:
    """Issue times of ``source``'s batches and, on a GPU, how many copies ended before their step did."""
    on_gpu = args.device == "cuda"
    real_event, copies = torch.cuda.Event, []

    def timed_event(*_args, **_kwargs):
        copies.append(real_event(enable_timing=True))
        return copies[-1]

    if on_gpu:  # the loader's copy events (one per batch, on its side stream), timed so they can be compared
        torch.cuda.Event = timed_event  # type: ignore[misc]
    try:
        data = torch.rand((args.batches + 2) * 64, 1024, 64, generator=torch.Generator().manual_seed(0))
        loader = ddpkit.DataLoader(TensorDataset(data), global_batch_size=64, num_workers=SOURCES[source], seed=0)
        batches = iter(loader)
        next(batches)
        time.sleep(1.0)  # the workers fill their queue, as they do during a real first step
        issue_ms, overlapped, step_ends = [], 0, []
        for index in range(args.batches):
            if on_gpu:
                torch.cuda._sleep(int(args.step_ms * cycles_per_ms))  # the step on the batch handed out last
                step_ends.append(real_event(enable_timing=True))
                step_ends[-1].record()
            started = time.perf_counter()
            next(batches)  # the batch after: its copy issued while the step runs
            if index >= args.warmup:
                issue_ms.append(1000 * (time.perf_counter() - started))
            if on_gpu:
                step_ends[-1].synchronize()  # as a loop reading its loss does: the next step starts on an idle GPU
        if on_gpu:
            torch.cuda.synchronize()
            # The copy issued during step i is the (i + 2)-th event: batch 0's and batch 1's came with next() above.
            for index in range(args.warmup, args.batches):
                overlapped += step_ends[index].elapsed_time(copies[index + 2]) <= 0
    finally:
        torch.cuda.Event = real_event  # type: ignore[misc]
    counted = args.batches - args.warmup
    return {
        "source": source,
        "device": args.device,
        "batch_mib": 16,
        "step_ms": args.step_ms if on_gpu else 0.0,
        "issue_ms_median": statistics.median(issue_ms),
        "issue_ms_max": max(issue_ms),
        "copies_overlapped": f"{overlapped}/{counted}" if on_gpu else None,
    }


def main() -> None:
    args = arguments()
    os.environ.setdefault("DDPKIT_LOG_LEVEL", "warning")
    ddpkit.init(device=args.device)
    cycles_per_ms = gpu_sleep.cycles_per_ms() if args.device == "cuda" else 0.0
    for source in SOURCES:
        print(json.dumps(measure(source, args, cycles_per_ms)), flush=True)
    ddpkit.shutdown()


if __name__ == "__main__":
    main()
