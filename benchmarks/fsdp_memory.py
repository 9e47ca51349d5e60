"""Per-rank memory and step time of DDP against FSDP (``shard=True``) at 1, 2 and 4 ranks, ~100M parameters.

    python benchmarks/fsdp_memory.py                                   # 1, 2, 4 ranks; DDP and FSDP
    python benchmarks/fsdp_memory.py --sizes 1 2 --blocks 2 --steps 2 --output /tmp/x   # a smoke run

The driver starts ``ddpkit run nproc=N benchmarks/fsdp_memory.py --worker``
once per world size and mode, one after the other, and writes
``<output>.json`` and ``<output>.md``.

The model: a tower of residual MLP blocks (LayerNorm, Linear width->4 width,
GELU, Linear 4 width->width), 12 blocks of width 1024 plus an input and an
output layer: 101M float32 parameters. A step: forward of a batch of
``--batch-size`` rows per rank, MSE, ``backward()``, AdamW's step,
``zero_grad()``. DDP is ``prepare_model(grad_sync="ddp")`` (at 1 rank the
plain module); FSDP is ``prepare_model(shard=True)`` (the 12 blocks sharded
one by one, then the root).

Measured on every rank:

- the bytes of the tensors the rank holds for training, counted exactly:
  parameters, gradients (after ``backward()``, before the step) and
  AdamW's state (its two moments and step counters), each DTensor as its
  local shard. DDP's gradient buckets (a second copy of the gradients,
  torch's DDP default) are listed apart, not in the total;
- on the CPU, the process's resident memory (RSS) sampled every 2 ms
  by a thread during the timed steps: its peak, and the same less the RSS
  before the model was built (torch's own libraries and buffers);
  on a GPU, ``torch.cuda.max_memory_allocated`` over the timed steps;
- the wall time of a step (mean over ``--steps`` after ``--warmup``), the
  slowest rank's.

On the CPU every rank builds the whole model before ``prepare_model``
shards it (no meta-device initialisation yet), so the process's high-water
mark from start-up would count the full model on every rank; the sampled
RSS of the training steps does not. glibc keeps memory freed into its heap
mapped (the full model's tensors, once sharded; a block's gathered
parameters, once resharded: its dynamic mmap threshold grows to 32 MiB and
sends such tensors to the heap), so the workers run with
``MALLOC_MMAP_THRESHOLD_=131072`` (every allocation above 128 KiB its own
mapping, unmapped when freed) and ``malloc_trim(0)`` before the timed
steps: RSS then shows what training holds, not what the heap kept.
Without them, FSDP's peak RSS above start at 4 ranks read 1,185 MiB
instead of 557 (DDP's hardly changes).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

MODES = ("ddp", "fsdp")


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4], help="world sizes")
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--blocks", type=int, default=12)
    parser.add_argument("--batch-size", type=int, default=8, help="rows per rank")
    parser.add_argument("--steps", type=int, default=5, help="timed steps")
    parser.add_argument("--warmup", type=int, default=2, help="steps before the timed ones")
    parser.add_argument("--output", default="", help="path without suffix; default benchmarks/fsdp-memory-<date>")
    parser.add_argument("--worker", action="store_true", help="(internal) run as one rank")
    parser.add_argument("--mode", choices=MODES, help="(internal) ddp or fsdp")
    parser.add_argument("--result", default="", help="(internal) where rank 0 writes the ranks' numbers")
    return parser.parse_args()


# -- one rank -------------------------------------------------------------------------


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class RssPeak:
    """The peak resident memory of this process while the block runs, sampled every 2 ms by a thread."""

    def __init__(self) -> None:
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, _rss())
            time.sleep(0.002)

    def __enter__(self) -> RssPeak:
        self.peak = _rss()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss())


def _malloc_trim() -> None:
    """Give the memory freed into glibc's heap back to the system (see the module docstring)."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    if name:
        ctypes.CDLL(name).malloc_trim(0)


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch import nn

    import ddpkit

    class Block(nn.Module):
        def __init__(self, width: int) -> None:
            super().__init__()
            self.norm = nn.LayerNorm(width)
            self.up = nn.Linear(width, 4 * width)
            self.down = nn.Linear(4 * width, width)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.down(F.gelu(self.up(self.norm(x))))

    class Tower(nn.Module):
        def __init__(self, width: int, num_blocks: int) -> None:
            super().__init__()
            self.inp = nn.Linear(width, width)
            self.blocks = nn.Sequential(*(Block(width) for _ in range(num_blocks)))
            self.out = nn.Linear(width, width)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.out(self.blocks(self.inp(x)))

    ctx = ddpkit.init()
    cuda = ctx.device.type == "cuda"
    rss_before = _rss()
    torch.manual_seed(0)
    net = Tower(args.width, args.blocks)
    num_parameters = sum(p.numel() for p in net.parameters())
    if args.mode == "fsdp":
        model = ddpkit.prepare_model(net, shard=True)
    else:
        model = ddpkit.prepare_model(net, grad_sync="ddp")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    generator = torch.Generator().manual_seed(ctx.rank)
    x = torch.randn(args.batch_size, args.width, generator=generator).to(ctx.device)
    y = torch.randn(args.batch_size, args.width, generator=generator).to(ctx.device)

    def local_bytes(t: torch.Tensor) -> int:
        t = t.to_local() if hasattr(t, "to_local") else t
        return t.numel() * t.element_size()

    counted: dict[str, int] = {}

    def step(count: bool) -> None:
        F.mse_loss(model(x), y).backward()
        if count:
            counted["gradients"] = sum(local_bytes(p.grad) for p in model.parameters() if p.grad is not None)
        optimizer.step()
        optimizer.zero_grad()

    for _ in range(args.warmup):
        step(False)
    _malloc_trim()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    dist.barrier()
    with RssPeak() as rss:
        start = time.perf_counter()
        for i in range(args.steps):
            step(i == args.steps - 1)
        if cuda:
            torch.cuda.synchronize()
        seconds = (time.perf_counter() - start) / args.steps
    counted["parameters"] = sum(local_bytes(p) for p in model.parameters())
    counted["optimizer"] = sum(
        local_bytes(v) for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v)
    )
    reducer = getattr(model, "reducer", None)
    buckets = 0
    if reducer is not None:  # DDP: its gradient buckets, beside the parameters' .grad
        buckets = sum(local_bytes(p) for p in model.parameters())
    mine = {
        "rank": ctx.rank,
        **counted,
        "total": counted["parameters"] + counted["gradients"] + counted["optimizer"],
        "ddp_buckets": buckets,
        "rss_peak": rss.peak,
        "rss_peak_above_start": rss.peak - rss_before,
        "cuda_max_allocated": torch.cuda.max_memory_allocated(ctx.device) if cuda else None,
        "step_s": seconds,
    }
    ranks: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(ranks, mine)
    if ctx.rank == 0:
        Path(args.result).write_text(
            json.dumps(
                {
                    "mode": args.mode,
                    "world_size": ctx.world_size,
                    "device": str(ctx.device),
                    "num_parameters": num_parameters,
                    "ranks": ranks,
                }
            )
        )
    ddpkit.shutdown()


# -- the driver -------------------------------------------------------------------------


def _machine() -> dict[str, Any]:
    import torch

    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpu": cpu,
        "cores": os.cpu_count(),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "load_average_before": os.getloadavg()[0],
    }


def driver(args: argparse.Namespace) -> None:
    date = datetime.datetime.now().strftime("%Y-%m-%d")
    output = Path(args.output or f"benchmarks/fsdp-memory-{date}")
    machine = _machine()
    runs = []
    with tempfile.TemporaryDirectory(prefix="fsdp-memory-") as tmp:
        for world_size in args.sizes:
            for mode in MODES:
                result = Path(tmp) / f"{mode}-{world_size}.json"
                command = [
                    sys.executable, "-m", "ddpkit", "run", f"nproc={world_size}", __file__, "--worker",
                    "--mode", mode, "--result", str(result), "--width", str(args.width), "--blocks",
                    str(args.blocks), "--batch-size", str(args.batch_size), "--steps", str(args.steps),
                    "--warmup", str(args.warmup),
                ]  # fmt: skip
                print(f"{mode} at {world_size} rank(s) ...", flush=True)
                environ = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"}  # see the module docstring
                subprocess.run(command, check=True, env=environ)
                runs.append(json.loads(result.read_text()))
    machine["load_average_after"] = os.getloadavg()[0]
    command = "python benchmarks/fsdp_memory.py " + " ".join(sys.argv[1:])
    report = {"command": command.strip(), "date": date, "machine": machine, "settings": vars(args), "runs": runs}
    for key in ("worker", "mode", "result"):
        report["settings"].pop(key)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    output.with_suffix(".md").write_text(markdown(report))
    print(markdown(report))


def _mb(n: float | None) -> str:
    return "-" if n is None else f"{n / 2**20:,.1f}"


def markdown(report: dict[str, Any]) -> str:
    runs = {(r["mode"], r["world_size"]): r for r in report["runs"]}
    machine, settings = report["machine"], report["settings"]
    first = report["runs"][0]
    lines = [
        f"# Per-rank memory and step time: DDP against FSDP (shard=true), {first['num_parameters'] / 1e6:.1f}M parameters",
        "",
        f"`{report['command']}` ({report['date']}, torch {machine['torch']}, {machine['cpu']}, {machine['cores']} cores"
        f"{', ' + machine['gpu'] if machine['gpu'] else ''}, device {first['device']}, load average (1 min) "
        f"{machine['load_average_before']:.1f} before, {machine['load_average_after']:.1f} after)",
        "",
        f"A tower of {settings['blocks']} residual MLP blocks of width {settings['width']}; AdamW; batch "
        f"{settings['batch_size']} rows per rank; {settings['steps']} timed steps after {settings['warmup']}. "
        "Memory is the largest rank's, in MiB. *State* is counted exactly: parameters + gradients + AdamW's "
        "state that the rank holds (its shards under FSDP). DDP's gradient buckets (a second copy of the "
        "gradients) are listed apart. RSS: peak resident memory sampled during the timed steps (CPU).",
        "",
        "| mode | ranks | parameters | gradients | AdamW state | state total | state / DDP's | DDP buckets "
        "| peak RSS | peak RSS - RSS at start | CUDA max allocated | step (s) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for (mode, world_size), run in sorted(runs.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        ranks = run["ranks"]

        def top(key: str, ranks: list[dict[str, Any]] = ranks) -> Any:
            values = [r[key] for r in ranks if r[key] is not None]
            return max(values) if values else None

        ddp = runs.get(("ddp", world_size))
        ratio = top("total") / max(r["total"] for r in ddp["ranks"]) if ddp else None
        lines.append(
            f"| {mode} | {world_size} | {_mb(top('parameters'))} | {_mb(top('gradients'))} | "
            f"{_mb(top('optimizer'))} | {_mb(top('total'))} | {'-' if ratio is None else f'{ratio:.3f}'} | "
            f"{_mb(top('ddp_buckets')) if top('ddp_buckets') else '-'} | {_mb(top('rss_peak'))} | "
            f"{_mb(top('rss_peak_above_start'))} | {_mb(top('cuda_max_allocated'))} | {top('step_s'):.3f} |"
        )
    lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    parsed = arguments()
    if parsed.worker:
        worker(parsed)
    else:
        driver(parsed)
