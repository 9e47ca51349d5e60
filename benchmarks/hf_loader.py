"""A Hugging Face Arrow dataset through ddpkit.DataLoader vs torch's DataLoader + DistributedSampler.

    ddpkit run nproc=2 benchmarks/hf_loader.py                  # 60,000 rows, 5 epochs of each, alternating
    ddpkit run nproc=2 benchmarks/hf_loader.py --rows 2000 --repeats 1 --output /tmp/x   # a smoke run

Rank 0 writes a 60,000-row dataset of 28x28 uint8 images and labels (random,
seeded: Fashion-MNIST's shape) with ``save_to_disk``; every rank opens it with
``load_from_disk`` (a memory-mapped Arrow file, as datasets are used) and
``with_format("torch")``. Then each rank trains W1 (the MLP) one epoch at a
time, alternating the two loaders, on the same model, optimizer and gradient
sync (``ddpkit.prepare_model``), with ``num_workers`` workers each:

- ddpkit: ``ddpkit.DataLoader(dataset, batch_size=32, shuffle=True, num_workers=2)``
- torch:  ``DataLoader(dataset, batch_size=32, sampler=DistributedSampler(dataset), num_workers=2)``

Both read a batch of rows in one Arrow call (the dataset's ``__getitems__``).
Throughput is samples over all ranks per second of an epoch; the ratio is
ddpkit's median over torch's. Rank 0 writes ``<output>.json`` and
``<output>.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DistributedSampler

import ddpkit


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=60000)
    parser.add_argument("--repeats", type=int, default=5, help="epochs of each loader, alternating")
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--num-workers", type=int, default=2)
    parser.add_argument("--output", default="", help="path without suffix; default benchmarks/hf-loader-<date>")
    return parser.parse_args()


def write_dataset(folder: str, rows: int) -> None:
    import datasets
    import numpy as np

    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (rows, 784), dtype=np.uint8)
    labels = rng.integers(0, 10, rows)
    features = datasets.Features(
        {"image": datasets.Sequence(datasets.Value("uint8"), length=784), "label": datasets.Value("int64")}
    )
    datasets.Dataset.from_dict({"image": images, "label": labels}, features=features).save_to_disk(folder)


def loaders(dataset, args: argparse.Namespace, ctx) -> dict[str, torch.utils.data.DataLoader]:
    sampler = DistributedSampler(dataset, num_replicas=ctx.world_size, rank=ctx.rank, shuffle=True, seed=0)
    return {
        "ddpkit": ddpkit.DataLoader(dataset, batch_size=args.batch_size, shuffle=True, num_workers=args.num_workers),
        "torch": torch.utils.data.DataLoader(
            dataset, batch_size=args.batch_size, sampler=sampler, num_workers=args.num_workers
        ),
    }


def cpu_seconds() -> float:
    """CPU time of this process and its finished children (the loader's workers, joined at an epoch's end)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def epoch(loader, number: int, model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[int, float, float]:
    """Samples this rank trained, the epoch's seconds (the ranks start together) and its CPU seconds."""
    loader.sampler.set_epoch(number)  # the DistributedSampler habit works for both
    dist.barrier()
    start, cpu, samples = time.perf_counter(), cpu_seconds(), 0
    for batch in loader:
        x, y = batch["image"].float().div_(255.0), batch["label"]
        loss = F.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        samples += len(y)
    return samples, time.perf_counter() - start, cpu_seconds() - cpu


def main() -> None:
    args = arguments()
    ctx = ddpkit.init()
    import datasets

    with tempfile.TemporaryDirectory(prefix="ddpkit-hf-bench-") as own:
        if ctx.rank == 0:
            write_dataset(own, args.rows)
        shared = [own]
        dist.broadcast_object_list(shared, src=0)  # every rank opens rank 0's files
        folder = shared[0]
        dataset = datasets.load_from_disk(folder).with_format("torch")
        torch.manual_seed(0)
        model = ddpkit.prepare_model(nn.Sequential(nn.Linear(784, 50), nn.ReLU(), nn.Linear(50, 10)))
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
        throughput: dict[str, list[float]] = {"ddpkit": [], "torch": []}
        cpu_per_sample: dict[str, list[float]] = {"ddpkit": [], "torch": []}
        built = loaders(dataset, args, ctx)
        for repeat in range(args.repeats):
            for name in ("ddpkit", "torch") if repeat % 2 == 0 else ("torch", "ddpkit"):
                samples, seconds, cpu = epoch(built[name], repeat, model, optimizer)
                slowest = torch.tensor([seconds], dtype=torch.float64)
                dist.all_reduce(slowest, op=dist.ReduceOp.MAX)  # the epoch ends with its slowest rank
                cpu_total = torch.tensor([cpu], dtype=torch.float64)
                dist.all_reduce(cpu_total)  # every rank's and its workers' CPU
                throughput[name].append(samples * ctx.world_size / float(slowest))
                cpu_per_sample[name].append(float(cpu_total) / (samples * ctx.world_size) * 1e6)
        dist.barrier()
    if ctx.rank == 0:
        report(args, ctx, throughput, cpu_per_sample)


def cpu_name() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        return next(line.split(":", 1)[1].strip() for line in lines if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def report(
    args: argparse.Namespace, ctx, throughput: dict[str, list[float]], cpu_per_sample: dict[str, list[float]]
) -> None:
    medians = {name: statistics.median(values) for name, values in throughput.items()}
    ratio = medians["ddpkit"] / medians["torch"]
    # Each repeat ran both loaders back to back: the ratio within a pair cancels the machine's drift.
    paired = statistics.median(d / t for d, t in zip(throughput["ddpkit"], throughput["torch"], strict=True))
    command = f"ddpkit run nproc={ctx.world_size} benchmarks/hf_loader.py --rows {args.rows} --repeats {args.repeats}"
    result = {
        "command": command,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "torch": torch.__version__,
        "datasets": __import__("datasets").__version__,
        "cpu": cpu_name(),
        "cores": os.cpu_count(),
        "world_size": ctx.world_size,
        "num_workers": args.num_workers,
        "rows": args.rows,
        "batch_size_per_rank": args.batch_size,
        "repeats": args.repeats,
        "samples_per_s": {name: [round(v, 1) for v in values] for name, values in throughput.items()},
        "median_samples_per_s": {name: round(v, 1) for name, v in medians.items()},
        "ratio_ddpkit_over_torch": round(ratio, 3),
        "median_paired_ratio": round(paired, 3),
        "cpu_us_per_sample": {name: [round(v, 1) for v in values] for name, values in cpu_per_sample.items()},
        "median_cpu_us_per_sample": {name: round(statistics.median(v), 1) for name, v in cpu_per_sample.items()},
    }
    output = Path(args.output or f"benchmarks/hf-loader-{time.strftime('%Y-%m-%d')}")
    output.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    output.with_suffix(".md").write_text(
        f"# HF Arrow dataset: ddpkit.DataLoader vs torch DataLoader + DistributedSampler\n\n"
        f"`{command}` ({result['date']}, torch {result['torch']}, datasets {result['datasets']}, "
        f"{result['cores']} cores)\n\n"
        f'{args.rows} rows of 784 uint8 pixels and a label, memory-mapped Arrow, `with_format("torch")`; '
        f"W1 (MLP) trained on {ctx.world_size} ranks, batch_size={args.batch_size} per rank, "
        f"num_workers={args.num_workers}; {args.repeats} epochs of each loader, alternating.\n\n"
        f"| loader | samples/s per epoch (all ranks) | median |\n|---|---|---|\n"
        + "".join(
            f"| {name} | {', '.join(f'{v:.0f}' for v in throughput[name])} | {medians[name]:.0f} |\n"
            for name in ("ddpkit", "torch")
        )
        + f"\nratio ddpkit / torch (medians): **{ratio:.3f}**; median of the ratios within each repeat "
        f"(both loaders back to back): {paired:.3f}\n\n"
        f"CPU per sample, all ranks and their loader workers (microseconds; less sensitive than the wall time "
        f"to other load on the machine): ddpkit {result['median_cpu_us_per_sample']['ddpkit']}, "
        f"torch {result['median_cpu_us_per_sample']['torch']}\n"
    )
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
