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
JSON line. ``ddpkit bench train t10=true`` runs it. ``device=cuda`` trains
on the GPU; a background write is hidden only where a window's steps outlast
it, so give the GPU a batch that makes a step take tens of milliseconds, as
a real step does (``batch_size=32768`` on an H100). With ``shard=true``,
under ``ddpkit run nproc=N -m ddpkit.bench.checkpoint_stall shard=true``,
the model is sharded over the workers (``prepare_model(shard=True)``) and
each save writes every worker's shards (torch.distributed.checkpoint); rank 0
prints the line, and the files compared are every worker's shards and the
other files (DCP's index holds a save's own id, so it differs).

T16, ``s3=true``: the same loop with the checkpoints in a bucket of moto's S3
server, started on loopback as a process of its own
(:mod:`ddpkit.bench.s3_server`). A Checkpointer on a URL stages each checkpoint
locally, as on disk, and uploads it in the background; the synchronous kind
waits for the upload right after the save (as a loop that saved to the bucket
directly would), the background kind waits at the window's end (where the next
save would). Last, the objects of one uploaded checkpoint are compared with
the files of a local save of the same state (:mod:`ddpkit.bench.s3_objects`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ddpkit.bench.s3_objects import same_objects
from ddpkit.bench.s3_server import loopback_s3
from ddpkit.bench.system import machine_info
from ddpkit.checkpoint import MANIFEST, Checkpointer, read_manifest
from ddpkit.keyvalue import ConfigError, check_choice, parse

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
    """Where the checkpoints go (a temporary folder by default; with shard=true one every worker sees)."""
    shard: bool = False
    """Shard the model over the workers of ``ddpkit run`` (FSDP2) and save sharded checkpoints."""
    device: str = "cpu"
    """Where the model trains: ``cpu``, or ``cuda`` (T10 on a GPU; the worker's GPU with ``shard=true``)."""
    s3: bool = False
    """T16: the checkpoints go to a bucket of a loopback S3 server (moto's, started here); a synchronous save
    waits for its upload, a background one uploads while the next steps run."""

    def __post_init__(self) -> None:
        check_choice("device", self.device, ("cpu", "cuda"))
        if self.s3 and self.shard:
            raise ConfigError("s3=true times one process's uploads; drop shard=true (or s3=true)")


def _model(cfg: StallConfig) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(cfg.io, cfg.width),
        nn.ReLU(),
        nn.Linear(cfg.width, cfg.width),
        nn.ReLU(),
        nn.Linear(cfg.width, cfg.io),
    )


def _window(
    cfg: StallConfig, model: nn.Module, optimizer: Any, batch: Any, ckpt: Checkpointer | None, wait_first: bool
) -> float:
    """Seconds of one window: a save (with ``ckpt``), ``every_steps`` steps, the write's end (async).

    ``wait_first``: the write (a remote checkpoint's upload) is waited for before the steps: a synchronous save.
    """
    start = time.perf_counter()
    if ckpt is not None:
        ckpt.save("every_steps")
        if wait_first:
            ckpt.wait()
    for _ in range(cfg.every_steps):
        F.mse_loss(model(batch[0]), batch[1]).backward()
        optimizer.step()
        optimizer.zero_grad()
    if batch[0].is_cuda:
        torch.cuda.synchronize()  # the steps' kernels ran; the write may still be running beside them
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
    first, second = paths
    if first is None or second is None:
        return False
    names = sorted(p.name for p in first.iterdir())
    if names != sorted(p.name for p in second.iterdir()):
        return False
    compared = [n for n in names if n not in _OWN_IDS]
    files = all((first / n).read_bytes() == (second / n).read_bytes() for n in compared)
    saved = (first, second)
    manifests = [{k: v for k, v in read_manifest(p).items() if k not in ("created", "files")} for p in saved]
    listed = [{k: v for k, v in read_manifest(p)["files"].items() if k not in _OWN_IDS} for p in saved]
    return files and manifests[0] == manifests[1] and listed[0] == listed[1]


_OWN_IDS = (MANIFEST, ".metadata")
"""Files that hold a save's own time or id: the manifest (its ``created``, compared without it) and DCP's index."""


def checkpoint_stall(cfg: StallConfig) -> dict[str, Any]:
    """Run the windows; return the medians, the time lost per save and whether the files are identical."""
    device = torch.device("cuda", torch.cuda.current_device()) if cfg.device == "cuda" else torch.device("cpu")
    model = _model(cfg)
    if cfg.shard:
        import ddpkit

        model = ddpkit.prepare_model(model, shard=True)
    else:
        model = model.to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    batch = torch.randn(cfg.batch_size, cfg.io, device=device), torch.randn(cfg.batch_size, cfg.io, device=device)
    windows: dict[str, list[float]] = {mode: [] for mode in MODES}
    with _folder(cfg) as tmp, _places(cfg, tmp) as place:
        ckpts = {
            mode: Checkpointer(
                place(mode),
                model=model,
                optimizer=optimizer,
                on_epoch_end=False,
                keep=1,
                preempt_signals=(),
                # On a URL both kinds stage alike; they differ in when the upload is waited for.
                async_save=mode == "async" and not cfg.s3,
                cache=str(Path(tmp) / f"staging-{mode}") if cfg.s3 else "",
            )
            for mode in ("sync", "async")
        }
        wait_first = {"none": False, "sync": cfg.s3, "async": False}
        for mode in MODES:  # warm-up: first allocations, first writes
            _window(cfg, model, optimizer, batch, ckpts.get(mode), wait_first[mode])
        for round_index in range(cfg.rounds):
            for mode in MODES:
                windows[mode].append(_window(cfg, model, optimizer, batch, ckpts.get(mode), wait_first[mode]))
            print(
                f"{'T16' if cfg.s3 else 'T10'} round {round_index + 1}: "
                + ", ".join(f"{m} {windows[m][-1]:.2f}s" for m in MODES),
                file=sys.stderr,
            )
        for ckpt in ckpts.values():
            ckpt.close()
        if cfg.s3:
            identical = same_objects(model, optimizer, Path(tmp), place("same-remote"))
        else:
            identical = _same_files(model, optimizer, Path(tmp))
        state_bytes = sum(p.stat().st_size for p in (Path(tmp) / "same-sync").rglob("*") if p.suffix != ".json")
    median = {mode: statistics.median(windows[mode]) for mode in MODES}
    lost = {mode: median[mode] - median["none"] for mode in ("sync", "async")}
    return {
        "target": "T16" if cfg.s3 else "T10",
        "machine": machine_info(),
        "config": dataclasses.asdict(cfg),
        "parameters": sum(_numel(p) for p in model.parameters()),
        "world_size": dist.get_world_size() if dist.is_initialized() else 1,
        "checkpoint_bytes": state_bytes,
        "windows_s": windows,
        "window_s_median": median,
        "lost_per_save_s": lost,
        "async_lost_over_sync_lost": lost["async"] / lost["sync"],
        "files_identical": identical,
    }


def _numel(parameter: torch.Tensor) -> int:
    """Elements of the whole parameter (a sharded one's global shape)."""
    return parameter.shape.numel()


@contextlib.contextmanager
def _places(cfg: StallConfig, tmp: str) -> Iterator[Callable[[str], str]]:
    """Where each Checkpointer writes, by name: a folder under ``tmp``, or (s3=true) a prefix of a bucket of a
    loopback S3 server started for the block."""
    if not cfg.s3:
        yield lambda name: str(Path(tmp) / name)
        return
    with loopback_s3() as bucket:
        yield lambda name: f"{bucket}/stall/{name}"


@contextlib.contextmanager
def _folder(cfg: StallConfig) -> Iterator[str]:
    """The checkpoints' folder: a new temporary one (made by rank 0 and shared when sharded), removed after."""
    if not cfg.shard:
        with tempfile.TemporaryDirectory(prefix="ddpkit-stall-", dir=cfg.folder or None) as tmp:
            yield tmp
        return
    box = [tempfile.mkdtemp(prefix="ddpkit-stall-", dir=cfg.folder or None) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    folder = box[0]
    assert folder is not None, "rank 0's, broadcast to every rank"
    try:
        yield folder
    finally:
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(folder, ignore_errors=True)


def main(words: list[str]) -> None:
    """Parse ``words`` (key=value), run, print the JSON line (rank 0 of a sharded run)."""
    try:
        cfg = parse(StallConfig, words)
    except ConfigError as e:
        sys.exit(f"error: {e}")
    if not cfg.shard:
        print(json.dumps(checkpoint_stall(cfg)), flush=True)
        return
    import ddpkit.distributed

    ddpkit.distributed.init(device=cfg.device)  # binds each worker's GPU with device=cuda
    try:
        result = checkpoint_stall(cfg)
        if dist.get_rank() == 0:
            print(json.dumps(result), flush=True)
    finally:
        ddpkit.distributed.shutdown()


if __name__ == "__main__":
    main(sys.argv[1:])
