"""Per-step cost of grad_sync=flat's designs: hooks copying (before), one copy at the end (now), landing in place.

    ddpkit run nproc=2 benchmarks/flat_grads.py                      # 300 rounds of 10 steps per variant
    ddpkit run nproc=2 benchmarks/flat_grads.py --blocks 2 --steps 3 --output /tmp/x   # a smoke run

Every rank trains W1's model (MLP 784-50-ReLU-10, Adam lr 1e-3, a batch of
32 per rank: W1's global 64 on 2 ranks, random inputs of Fashion-MNIST's
shape, drawn once) with one copy of the model per variant, all starting from
the same weights. A step is torch's loop: forward, cross-entropy,
``backward()`` (gradients averaged when it returns), ``optimizer.step()``,
``optimizer.zero_grad()`` (torch's default ``set_to_none=True``). Designs:

- ``hooks+copy``: the design of commit 7abaa16, rebuilt here on
  ``FlatGradients``: a closure per parameter, as its post-accumulate-grad
  hook, queues the end-of-backward all_reduce and copies autograd's fresh
  gradient into the view, parameter by parameter.
- ``copy-at-end``: ``prepare_model(grad_sync="flat")`` now: one bound method
  as every parameter's hook only queues the all_reduce; at the end of
  backward the fresh gradients are copied into their views in one loop.
- ``direct``: the same plus a forward pre-hook that gives the ``.grad``
  dropped by ``zero_grad`` their views back, zeroed, so that autograd
  accumulates into the buffer in place (no fresh gradient, no copy).

Each design runs with the shared-memory all_reduce (``shm``) and with an
all_reduce that moves nothing (``none``: the design's own cost); ``unsynced``
is the plain model (the floor). The variants take turns block by block (a
barrier before each block), so that load from elsewhere on the shared
machine hits them alike. A block's time is the slowest rank's mean step, in
wall time and in CPU time of the rank's process; the figures are medians
over blocks, and each ratio is the median over rounds of the ratio to
``hooks+copy`` (same all_reduce) in the same round. Rank 0 writes
``<output>.json`` and ``<output>.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import ddpkit
from ddpkit.comm.flat_grads import FlatGradients
from ddpkit.comm.grad_sync import GradientSync
from ddpkit.comm.ops import ReduceOp

DESIGNS = ("hooks+copy", "copy-at-end", "direct")
BASELINE = "hooks+copy"
VARIANTS = tuple(f"{design}, {communication}" for communication in ("shm", "none") for design in DESIGNS) + (
    "unsynced",
)
"""Each design with the shared-memory all_reduce, and with an all_reduce that moves nothing."""

_graph_task_id = torch._C._current_graph_task_id
_queue_callback = torch.autograd.Variable._execution_engine.queue_callback


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=300, help="rounds: a block of every variant each, taking turns")
    parser.add_argument("--steps", type=int, default=10, help="steps per block")
    parser.add_argument("--warmup", type=int, default=20, help="steps per design before measuring")
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--output", default="", help="path without suffix; default benchmarks/flat-grads-<date>")
    return parser.parse_args()


def w1_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(784, 50), nn.ReLU(), nn.Linear(50, 10))


def hooks_and_copy(model: nn.Module, all_reduce: Callable[..., None], averaging: bool) -> FlatGradients:
    """The flat design of commit 7abaa16: one hook per parameter, fresh gradients copied into the views."""
    flat = FlatGradients(model, all_reduce, averaging=averaging)
    state = {"graph_task": -1}

    def average() -> None:
        flat.take_back_views()  # as 7abaa16's callback: a missing gradient counts as zero
        flat.reduce_buffers()

    def hook_for(view: torch.Tensor) -> Callable[[torch.Tensor], None]:
        def hook(param: torch.Tensor) -> None:
            if _graph_task_id() != state["graph_task"]:
                state["graph_task"] = _graph_task_id()
                _queue_callback(average)
            if param.grad is not view:
                view.copy_(param.grad)
                param.grad = view

        return hook

    for param, view in zip(flat.params, flat.views):
        param.register_post_accumulate_grad_hook(hook_for(view))
    return flat


def no_all_reduce(tensor: torch.Tensor, op: object = None, group: object = None) -> None:
    """An all_reduce that moves nothing: what is left is the design's own cost."""


def build(variant: str, ctx: ddpkit.Context) -> nn.Module:
    """``variant``'s model on this rank (every copy starts from seed 0's weights)."""
    design, _, communication = variant.partition(", ")
    model = w1_model()
    if design == "unsynced":
        return model
    if design == BASELINE:
        from ddpkit.comm.registry import resolve_allreduce

        all_reduce = resolve_allreduce("shm")  # the function prepare_model's flat mode calls
        if communication == "shm":
            model._flat_gradients = hooks_and_copy(model, all_reduce, averaging=True)  # alive with the model
        else:
            model._flat_gradients = hooks_and_copy(model, no_all_reduce, averaging=False)
        return model
    if communication == "shm":
        model = ddpkit.prepare_model(model, allreduce="shm", grad_sync="flat")
        model._sync = ddpkit.gradient_sync(model)
    else:  # the way prepare_model builds it, with the all_reduce injected (as `ddpkit bench scaling` does)
        model._sync = GradientSync(model, ctx, "shm", "flat", all_reduce_fn=no_all_reduce)
    assert model._sync.describe().startswith("gradients: flat of 155 KiB with all_reduce=shm")
    if design == "direct":
        model.register_forward_pre_hook(restore_views_hook(model._sync.flat))
    return model


def restore_views_hook(flat: FlatGradients) -> Callable[[nn.Module, object], None]:
    """A forward pre-hook giving every ``.grad`` that zero_grad dropped its view back, zeroed."""

    def restore_views(module: nn.Module, args: object) -> None:
        missing = [(param, view) for param, view in zip(flat.params, flat.views) if param.grad is None]
        if len(missing) == len(flat.params):
            for buffer in flat.buffers:
                buffer.zero_()
        else:
            for _, view in missing:
                view.zero_()
        for param, view in missing:
            param.grad = view

    return restore_views


def timed_steps(model: nn.Module, optimizer: torch.optim.Optimizer, batches: list, steps: int) -> torch.Tensor:
    """Wall and CPU seconds per step of forward, backward, step and zero_grad (this rank)."""
    start, cpu_start = time.perf_counter(), time.process_time()
    for i in range(steps):
        x, y = batches[i % len(batches)]
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    return torch.tensor([time.perf_counter() - start, time.process_time() - cpu_start], dtype=torch.float64) / steps


def main() -> None:
    args = arguments()
    ctx = ddpkit.init()
    generator = torch.Generator().manual_seed(ctx.rank)
    batches = [
        (torch.rand(args.batch_size, 1, 28, 28, generator=generator), torch.randint(0, 10, (args.batch_size,)))
        for _ in range(8)
    ]
    models = {variant: build(variant, ctx) for variant in VARIANTS}
    optimizers = {variant: torch.optim.Adam(models[variant].parameters(), lr=1e-3) for variant in VARIANTS}
    for variant in VARIANTS:
        timed_steps(models[variant], optimizers[variant], batches, args.warmup)
    times: dict[str, list[float]] = {variant: [] for variant in VARIANTS}
    cpu_times: dict[str, list[float]] = {variant: [] for variant in VARIANTS}
    load_before = os.getloadavg()[0]
    for block in range(args.blocks):
        for variant in VARIANTS if block % 2 == 0 else VARIANTS[::-1]:
            dist.barrier()
            seconds = timed_steps(models[variant], optimizers[variant], batches, args.steps)
            dist.all_reduce(seconds, op=ReduceOp.MAX)  # the step ends with its slowest rank
            times[variant].append(float(seconds[0]) * 1e6)
            cpu_times[variant].append(float(seconds[1]) * 1e6)
    check_ranks_agree(models)
    if ctx.rank == 0:
        report(args, ctx, {"wall": times, "cpu": cpu_times}, load_before)


def check_ranks_agree(models: dict[str, nn.Module]) -> None:
    """The designs that averaged for real left every rank the same weights (else their timings mean nothing)."""
    for variant, model in models.items():
        if not variant.endswith(", shm"):
            continue
        weights = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        first = weights.clone()
        dist.broadcast(first, src=0)
        assert torch.equal(weights, first), f"{variant}: the ranks' weights differ"


def baseline_of(variant: str) -> str:
    """The old design with the same all_reduce (the unsynced floor compares with the real one)."""
    return f"{BASELINE}, {'none' if variant.endswith(', none') else 'shm'}"


def cpu_name() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        return next(line.split(":", 1)[1].strip() for line in lines if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def summary(times: dict[str, list[float]]) -> dict[str, dict[str, float]]:
    """Per variant: the median, min and max us per step, and the median ratio to the old design in the same round."""
    # Each round ran every variant back to back: the ratio within a round cancels the machine's drift.
    return {
        variant: {
            "median": round(statistics.median(values), 1),
            "min": round(min(values), 1),
            "max": round(max(values), 1),
            "ratio": round(
                statistics.median(t / b for t, b in zip(values, times[baseline_of(variant)], strict=True)), 4
            ),
        }
        for variant, values in times.items()
    }


def table(stats: dict[str, dict[str, float]]) -> str:
    rows = "".join(
        f"| {variant} | {s['median']:.1f} | {s['min']:.1f} | {s['max']:.1f} | {s['ratio']:.3f} "
        f"| {s['median'] - stats[baseline_of(variant)]['median']:+.1f} |\n"
        for variant, s in stats.items()
    )
    return (
        f"| variant | median us/step | min | max | median ratio to {BASELINE} (same all_reduce, same round) "
        f"| median - {BASELINE}'s median (us) |\n|---|---|---|---|---|---|\n" + rows
    )


def report(
    args: argparse.Namespace, ctx: ddpkit.Context, times: dict[str, dict[str, list[float]]], load_before: float
) -> None:
    stats = {kind: summary(values) for kind, values in times.items()}
    command = f"ddpkit run nproc={ctx.world_size} benchmarks/flat_grads.py --blocks {args.blocks} --steps {args.steps}"
    result = {
        "command": command,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "torch": torch.__version__,
        "cpu": cpu_name(),
        "cores": os.cpu_count(),
        "world_size": ctx.world_size,
        "batch_size_per_rank": args.batch_size,
        "blocks": args.blocks,
        "steps_per_block": args.steps,
        "load_before": load_before,
        "load_after": os.getloadavg()[0],
        "wall_us_per_step": stats["wall"],
        "cpu_us_per_step": stats["cpu"],
        "blocks_wall_us_per_step": {
            variant: [round(v, 1) for v in values] for variant, values in times["wall"].items()
        },
        "blocks_cpu_us_per_step": {variant: [round(v, 1) for v in values] for variant, values in times["cpu"].items()},
    }
    output = Path(args.output or f"benchmarks/flat-grads-{time.strftime('%Y-%m-%d')}")
    output.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    output.with_suffix(".md").write_text(
        f"# grad_sync=flat: per-step cost of each design, W1's MLP on {ctx.world_size} ranks\n\n"
        f"`{command}` ({result['date']}, torch {result['torch']}, {result['cpu']}, {result['cores']} cores, "
        f"load average (1 min) {load_before:.1f} before, {result['load_after']:.1f} after)\n\n"
        f"A step: forward, cross-entropy, backward (gradients averaged when it returns), Adam's step, "
        f"`optimizer.zero_grad()` (set_to_none=True); batch {args.batch_size} per rank. {args.blocks} rounds; "
        f"in each, every variant runs a block of {args.steps} steps, back to back; a block's time is its "
        f"slowest rank's mean step. `shm`: averaged with the shared-memory all_reduce; `none`: with an "
        f"all_reduce that moves nothing (the design's own cost). Designs: see the script's docstring.\n\n"
        f"## Wall time\n\n{table(stats['wall'])}\n"
        f"## CPU time of the rank's process (less sensitive to other load on the machine; includes the "
        f"all_reduce's spinning wait)\n\n{table(stats['cpu'])}"
    )
    print(json.dumps({key: result[key] for key in ("command", "wall_us_per_step", "cpu_us_per_step")}), flush=True)


if __name__ == "__main__":
    main()
