"""Where an own loop's time goes on a GPU: T11's training in one process, one ddpkit part at a time.

    python benchmarks/gpu_loop_parts.py --model mlp     # on a GPU; --device cpu --samples 2048 to try it

One process (``ddpkit.init()`` alone, world size 1), one model, the data of
``benchmarks/peers/workload.py`` (per-sample crop and flip, 8 loader
workers, batch 256, bf16 autocast, SGD). Each variant trains ``--epochs``
epochs and reports images/s over all but the first, the median step and the
longest epoch boundary (from the end of one epoch's last step to the next
epoch's first batch). Variants, alternated over ``--rounds`` (in reverse order every other round, so that
no variant always follows the same one):

- ``torch``: torch's DataLoader (``pin_memory=True``), ``x.to(device, non_blocking=True)``,
  ``torch.save`` on rank 0 at each epoch end: the plain torch loop;
- ``ddpkit``: ``ddpkit.DataLoader`` and a ``Checkpointer`` holding it: the README's loop (on a GPU its
  saves are written in the background);
- ``ddpkit-sync-saves``: the same with ``async_save=False``;
- ``ddpkit-no-checkpointer``: the same without the Checkpointer;
- ``ddpkit-cpu-batches``: ``ddpkit.DataLoader(device=None, pin_memory=True)`` and the loop's own
  ``.to(device, non_blocking=True)``, no Checkpointer;
- ``ddpkit-unseeded``: ``seed_per_sample=False``, no Checkpointer.

Prints one JSON line per variant and round, then a Markdown table of the
medians (``summary``; ``--summarize FILE`` prints it for saved JSON lines).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

import ddpkit

sys.path.insert(0, str(Path(__file__).resolve().parent / "peers"))
import workload  # noqa: E402

VARIANTS = ("torch", "ddpkit", "ddpkit-sync-saves", "ddpkit-no-checkpointer", "ddpkit-cpu-batches", "ddpkit-unseeded")


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("mlp", "resnet18"), default="mlp")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--samples", type=int, default=25_000)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--num-workers", type=int, default=8)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--summarize", metavar="FILE", help="print the table of saved JSON lines and stop")
    return parser.parse_args()


def loader_and_checkpointer(variant: str, dataset, model, optimizer, args, folder: str):
    common = {"batch_size": 256, "shuffle": True, "num_workers": args.num_workers, "drop_last": True}
    common["persistent_workers"] = args.num_workers > 0
    if variant == "torch":
        return DataLoader(dataset, pin_memory=args.device == "cuda", **common), None
    options = {"seed": 0}
    if variant == "ddpkit-cpu-batches":
        options.update(device=None, pin_memory=args.device == "cuda")
    if variant == "ddpkit-unseeded":
        options.update(seed_per_sample=False)
    loader = ddpkit.DataLoader(dataset, **common, **options)
    if variant not in ("ddpkit", "ddpkit-sync-saves"):
        return loader, None
    async_save = False if variant == "ddpkit-sync-saves" else "auto"
    ckpt = ddpkit.Checkpointer(folder, model=model, optimizer=optimizer, loader=loader, async_save=async_save)
    ckpt.resume("never")
    return loader, ckpt


def train(variant: str, args, model, device) -> dict:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    dataset = workload.AugmentedImages(args.samples)
    with tempfile.TemporaryDirectory(prefix="loop-parts-") as folder:
        loader, ckpt = loader_and_checkpointer(variant, dataset, model, optimizer, args, folder)
        steps, boundaries, images, timed = [], [], 0, 0.0
        last_step_end = None
        for epoch in range(args.epochs):
            if hasattr(loader, "set_epoch"):
                loader.set_epoch(epoch)
            elif hasattr(loader.sampler, "set_epoch"):
                loader.sampler.set_epoch(epoch)
            epoch_start = time.perf_counter()
            first = True
            for x, y in loader:
                now = time.perf_counter()
                if first and last_step_end is not None and epoch > 1:
                    boundaries.append(now - last_step_end)
                first = False
                if variant in ("torch", "ddpkit-cpu-batches"):
                    x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                with torch.autocast(device.type, dtype=torch.bfloat16):
                    loss = F.cross_entropy(model(x), y)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                if ckpt is not None:
                    ckpt.step()
                last_step_end = time.perf_counter()
                if epoch > 0:
                    steps.append(last_step_end - now)
                    images += len(y)
            if variant == "torch":
                torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, f"{folder}/ckpt.pt")
            if ckpt is not None and epoch == args.epochs - 1:
                ckpt.close()  # writes the last epoch's checkpoint: timed, as torch's last save is
            if device.type == "cuda":
                torch.cuda.synchronize()
            if epoch > 0:
                timed += time.perf_counter() - epoch_start
        if ckpt is not None:
            ckpt.close()
    return {
        "variant": variant,
        "images_per_s": images / timed,
        "step_ms_median": 1000 * statistics.median(steps),
        "boundary_ms_max": 1000 * max(boundaries) if boundaries else None,
    }


def summary(results: list[dict]) -> str:
    """A Markdown table: each variant's median images/s, step and epoch boundary, and images/s over torch's."""
    by_variant: dict[str, list[dict]] = {}
    for result in results:
        by_variant.setdefault(result["variant"], []).append(result)
    torch_rate = statistics.median(r["images_per_s"] for r in by_variant.get("torch", [{"images_per_s": 0}]))
    lines = [
        "| variant | images/s (median; rounds) | / torch | step (ms, median) | longest epoch boundary (ms) |",
        "|---|---|---|---|---|",
    ]
    for variant, rows in by_variant.items():
        rate = statistics.median(r["images_per_s"] for r in rows)
        rounds = ", ".join(f"{r['images_per_s']:,.0f}" for r in rows)
        ratio = f"{rate / torch_rate:.2f}" if torch_rate else "-"
        step = statistics.median(r["step_ms_median"] for r in rows)
        boundary = max((r["boundary_ms_max"] or 0) for r in rows)
        lines.append(f"| {variant} | {rate:,.0f} ({rounds}) | {ratio} | {step:.2f} | {boundary:.0f} |")
    return "\n".join(lines)


def main() -> None:
    args = arguments()
    if args.summarize:
        print(summary([json.loads(line) for line in Path(args.summarize).read_text().splitlines() if line]))
        return
    os.environ.setdefault("DDPKIT_LOG_LEVEL", "warning")
    ctx = ddpkit.init(device=args.device)
    device = ctx.device
    model = ddpkit.prepare_model(workload.build_model(argparse.Namespace(model=args.model, width=64)))
    results = []
    for round_index in range(args.rounds):
        variants = args.variants.split(",")
        for variant in variants if round_index % 2 == 0 else variants[::-1]:
            results.append({"round": round_index, "model": args.model, **train(variant, args, model, device)})
            print(json.dumps(results[-1]), flush=True)
            # The variant's loader and its persistent workers go now, not in a later variant's forked workers.
            gc.collect()
    print(summary(results), flush=True)
    ddpkit.shutdown()


if __name__ == "__main__":
    main()
