"""T10: what a checkpoint costs the training loop, synchronous against ``async_save=True``.

An own loop trains a ~25M-parameter MLP (1024-4096-4096-1024, ReLU; about
300 MB with Adam's two moments) on random batches, saving every 10 steps
through a ``Checkpointer``. The loop is timed in windows of 10 steps, each
window one of three kinds, in turn: no save; a synchronous save and then 10
steps; an ``async_save=True`` save, 10 steps, and a wait for the write if it
is still running (a loop saving every 10 steps would wait there, at its next
save). Windows alternate finely because the machine is shared: a slow
minute then touches every kind alike. The loop's time lost per save is a
kind's median window minus the median window without a save. Last, one
synchronous and one asynchronous save of the same state are compared file by
file.

Run as ``python -m ddpkit.bench.checkpoint_stall key=value ...``; prints one
JSON line. ``ddpkit bench train t10=true`` runs it.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ddpkit.checkpoint.format import MANIFEST, read_manifest
from ddpkit.checkpoint.manager import Checkpointer
from ddpkit.config import parse

MODES = ("none", "sync", "async")


@dataclasses.dataclass
class StallConfig:
    """Options of the checkpoint-stall benchmark (key=value)."""

    width: int = 4096
    """Hidden width of the MLP (4096: 25.2M parameters)."""
    io: int = 1024
    """Input and output width."""
    batch_size: int = 32
    """Samples per step."""
    every_steps: int = 10
    """Steps between saves: the length of a window."""
    rounds: int = 10
    """Rounds of the three kinds of window, alternated."""
    folder: str = ""
    """Where the checkpoints go (a temporary folder by default)."""


def _model(cfg: StallConfig) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(cfg.io, cfg.width),
        nn.ReLU(),
        nn.Linear(cfg.width, cfg.width),
        nn.ReLU(),
        nn.Linear(cfg.width, cfg.io),
    )


def _window(cfg: StallConfig, model: nn.Module, optimizer: Any, batch: Any, ckpt: Checkpointer | None) -> float:
    """Seconds of one window: a save (with ``ckpt``), ``every_steps`` steps, the write's end (async)."""
    start = time.perf_counter()
    if ckpt is not None:
        ckpt.save("every_steps")
    for _ in range(cfg.every_steps):
        F.mse_loss(model(batch[0]), batch[1]).backward()
        optimizer.step()
        optimizer.zero_grad()
    if ckpt is not None:
        ckpt.global_step += cfg.every_steps
        ckpt.wait()  # returns at once when the write is done
    return time.perf_counter() - start


def _same_files(model: nn.Module, optimizer: Any, folder: Path) -> bool:
    """One sync and one async save of the same state: every file identical (the manifest but its time)."""
    paths = []
    for mode in ("sync", "async"):
        ckpt = Checkpointer(
            folder / f"same-{mode}",
            model=model,
            optimizer=optimizer,
            on_epoch_end=False,
            preempt_signals=(),
            async_save=mode == "async",
        )
        paths.append(ckpt.save())
        ckpt.close()
    names = sorted(p.name for p in paths[0].iterdir())
    if names != sorted(p.name for p in paths[1].iterdir()):
        return False
    files = all((paths[0] / n).read_bytes() == (paths[1] / n).read_bytes() for n in names if n != MANIFEST)
    manifests = [{k: v for k, v in read_manifest(p).items() if k != "created"} for p in paths]
    return files and manifests[0] == manifests[1]


def checkpoint_stall(cfg: StallConfig) -> dict[str, Any]:
    """Run the windows; return the medians, the time lost per save and whether the files are identical."""
    model = _model(cfg)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    batch = torch.randn(cfg.batch_size, cfg.io), torch.randn(cfg.batch_size, cfg.io)
    windows: dict[str, list[float]] = {mode: [] for mode in MODES}
    with tempfile.TemporaryDirectory(prefix="ddpkit-stall-", dir=cfg.folder or None) as tmp:
        ckpts = {
            mode: Checkpointer(
                Path(tmp) / mode,
                model=model,
                optimizer=optimizer,
                on_epoch_end=False,
                keep=1,
                preempt_signals=(),
                async_save=mode == "async",
            )
            for mode in ("sync", "async")
        }
        for mode in MODES:  # warm-up: first allocations, first writes
            _window(cfg, model, optimizer, batch, ckpts.get(mode))
        for round_index in range(cfg.rounds):
            for mode in MODES:
                windows[mode].append(_window(cfg, model, optimizer, batch, ckpts.get(mode)))
            print(
                f"T10 round {round_index + 1}: " + ", ".join(f"{m} {windows[m][-1]:.2f}s" for m in MODES),
                file=sys.stderr,
            )
        for ckpt in ckpts.values():
            ckpt.close()
        identical = _same_files(model, optimizer, Path(tmp))
        state_bytes = sum(p.stat().st_size for p in (Path(tmp) / "same-sync").rglob("*.pt"))
    median = {mode: statistics.median(windows[mode]) for mode in MODES}
    lost = {mode: median[mode] - median["none"] for mode in ("sync", "async")}
    return {
        "config": dataclasses.asdict(cfg),
        "parameters": sum(p.numel() for p in model.parameters()),
        "checkpoint_bytes": state_bytes,
        "windows_s": windows,
        "window_s_median": median,
        "lost_per_save_s": lost,
        "async_lost_over_sync_lost": lost["async"] / lost["sync"],
        "files_identical": identical,
    }


if __name__ == "__main__":
    print(json.dumps(checkpoint_stall(parse(StallConfig, sys.argv[1:]))), flush=True)
