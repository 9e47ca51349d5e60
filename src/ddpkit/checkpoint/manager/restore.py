"""Restoring a checkpoint into the Checkpointer's objects, and the one line that says where a run continues.

Rank 0 chooses the checkpoint (:mod:`~ddpkit.checkpoint.manager.select`) and every
rank learns its choice (:func:`choose_and_load`); :func:`restore_checkpoint`
puts it back and returns what the Checkpointer then applies (:class:`Restored`).
Each object gets its ``<name>.pt`` through ``load_state_dict``; a checkpoint
that holds other objects than the run passes, or whose state does not fit
them, is refused in one line naming the difference and the fix. Each rank
restores its own generator states; a rank the checkpoint did not have (a
larger world size) gets a stream of its own.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ddpkit.checkpoint.disk.format import CheckpointError, load_file, read_manifest
from ddpkit.checkpoint.manager import select
from ddpkit.checkpoint.objects import RNG_FILE, TRAIN_FILE
from ddpkit.checkpoint.ranks import on_rank_zero
from ddpkit.checkpoint.rng import capture_rng_state, restore_rng_state, seed_everything
from ddpkit.checkpoint.sharded.state import ShardedState, sharded_names
from ddpkit.data.position import LoaderPosition
from ddpkit.distributed import nodes_change_line
from ddpkit.log import get_logger

__all__ = [
    "ResumePoint",
    "Restored",
    "choose_and_load",
    "continue_batches",
    "epoch_length",
    "load_files",
    "log_resume",
    "restore_checkpoint",
    "restore_objects",
    "restore_rng",
    "resume_point_by_length",
    "world_size_line",
]

AT_STEP_REASONS = ("every_steps", "every_seconds", "preempted")
"""Why a checkpoint is written inside ``step()``: without a ddpkit.DataLoader, before the code after the batch loop."""


@dataclass(frozen=True)
class ResumePoint:
    """Where a run continues: returned by :meth:`Checkpointer.resume`."""

    epoch: int = 0
    """The epoch to train next, numbered as the loop numbers them (``set_epoch``): the one in progress
    after a mid-epoch checkpoint, or one whose batches are all trained (``step_in_epoch`` equal to
    the loader's ``steps_per_epoch``) so that the code after its batch loop runs again; on a fresh
    start, ``first_epoch``."""
    step_in_epoch: int = 0
    """Batches of ``epoch`` already trained: a ddpkit.DataLoader given as ``loader=`` skips them; a torch
    DataLoader is skipped by ``for i, batch in ckpt.enumerate(loader)``; otherwise the loop must skip them
    (``itertools.islice(loader, start.step_in_epoch, None)``), or they are trained twice."""
    global_step: int = 0
    """Optimizer steps done since the start of training."""
    path: Path | None = None
    """The checkpoint resumed from; None for a fresh start."""
    manifest: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)
    """The manifest of that checkpoint (config, metrics, world size...); {} for a fresh start."""
    finished: bool = False
    """True when the run that wrote it had finished: ``close()`` after its last step, with nothing after it.
    A loop whose end has not moved has nothing left to train (``if start.finished: return``)."""

    @property
    def resumed(self) -> bool:
        """True when state was restored from a checkpoint."""
        return self.path is not None


@dataclass(frozen=True)
class Restored:
    """What restoring a checkpoint hands back to the Checkpointer: its counters and manifest facts."""

    global_step: int
    completed_epochs: int
    epoch_start_step: int
    """Without a loader: the global step of the last ``epoch_end()`` before it."""
    saved_world_size: int
    """The world size that wrote it."""
    finished: bool
    """The run that wrote it had finished (``close()`` after it)."""
    metrics: dict[str, float]
    """The metrics of its step."""
    best: Mapping[str, Any]
    """The manifest's ``best`` entry."""
    reason: str = ""
    """Why it was written (every_steps, preempted, epoch_end, ...)."""


def choose_and_load(
    root: Path,
    choice: str,
    restart: int,
    *,
    before: Callable[[str], str],
    rank: int,
    world_size: int,
    stage: Callable[[Path], Path] = lambda path: path,
    shown: Callable[[Path], str] = str,
) -> tuple[Path | None, dict[str, Any]]:
    """Rank 0 chooses the checkpoint to resume; every rank learns it and holds its files (a collective).

    Args:
        root: the checkpoints folder.
        choice: "auto", "never" or the path of one checkpoint (:func:`ddpkit.checkpoint.manager.select.choose_checkpoint`).
        restart: the restart count (a restarted worker resumes the newest).
        before: run on rank 0 with ``choice`` before it chooses (the writes in flight are finished); returns
            the choice to make (a remote checkpoint's URL: its staged copy).
        rank: this process's rank.
        world_size: the number of ranks.
        stage: run on the other ranks before they read the checkpoint: where it is on their node (a remote
            folder's copy in their staging folder).
        shown: how rank 0's lines name a checkpoint or ``root`` (a remote folder's staged copy: its URL).

    Returns:
        The checkpoint (None: a fresh start) and its files by name with ``"manifest"`` ({} for a fresh start).
    """
    found: dict[str, Any] = {}

    def choose() -> str:
        path, found["loaded"] = select.choose_checkpoint(root, before(choice), restart, shown)
        return str(path) if path else ""

    chosen = on_rank_zero(choose, rank, world_size)
    if not chosen:
        return None, {}
    path = Path(chosen)
    if rank != 0:
        path = stage(path)
    # Rank 0 verified the files moments ago; the others read them.
    loaded = found["loaded"] if found.get("loaded") is not None else load_files(path)
    return path, loaded


def restore_checkpoint(
    path: Path,
    loaded: dict[str, Any],
    objects: dict[str, Any],
    per_rank: list[str],
    shards: ShardedState | None,
    rank: int,
    world_size: int,
) -> Restored:
    """Restore every object and this rank's generators from ``loaded`` (a collective for a sharded checkpoint).

    Args:
        path: the checkpoint.
        loaded: its files by name, with ``"manifest"`` (:func:`choose_and_load`).
        objects: the Checkpointer's objects by name.
        per_rank: the names of the objects saved for every rank.
        shards: this run's sharded model state; None for a replicated model.
        rank: this process's rank.
        world_size: the number of ranks.

    Raises:
        CheckpointError: the checkpoint does not fit the objects (other objects, a state that does not fit).
    """
    restored = sharded_names(loaded["manifest"])
    if restored:  # every rank reads its slices (a plain model reads them all)
        (shards or ShardedState(objects["model"], objects.get("optimizer"), rank, world_size)).load(path)
    elif shards is not None:  # a replicated checkpoint, which every rank read whole: each keeps its shards
        shards.load_whole(path, loaded["model.pt"], loaded.get("optimizer.pt") if "optimizer" in objects else None)
        restored = shards.names
        if rank == 0:
            get_logger().info(f"checkpoint {path.name} holds a replicated model: every rank keeps its shards of it")
    counters = restore_objects(path, objects, loaded, per_rank, rank, restored=restored)
    global_step = int(counters["global_step"])
    completed_epochs = int(counters["completed_epochs"])
    epoch_start_step = int(counters.get("epoch_start_step", global_step))
    saved_world_size = restore_rng(loaded, rank, global_step)
    manifest: Mapping[str, Any] = loaded["manifest"]
    return Restored(
        global_step=global_step,
        completed_epochs=completed_epochs,
        epoch_start_step=epoch_start_step,
        saved_world_size=saved_world_size,
        finished=bool(manifest.get("finished")),
        metrics=dict(manifest.get("metrics") or {}),
        best=manifest.get("best", {}),
        reason=str(manifest.get("reason", "")),
    )


def epoch_length(loader: Any) -> int | None:
    """Batches per epoch of a torch DataLoader without state of its own (its ``len()``); None for anything else.

    With it, a Checkpointer whose loop does not call ``epoch_end()`` still knows in which epoch a step falls.
    """
    if not isinstance(loader, torch.utils.data.DataLoader) or hasattr(loader, "state_dict"):
        return None
    try:
        return len(loader) or None
    except TypeError:  # an IterableDataset without __len__: its epochs are known at their end only
        return None


def resume_point_by_length(global_step: int, steps_per_epoch: int, first_epoch: int, reason: str) -> tuple[int, int]:
    """(epoch to train next, batches of it done) of a checkpoint of ``global_step``, one step per batch.

    A checkpoint of an epoch's last step taken inside ``step()`` (``reason`` in AT_STEP_REASONS) was written
    before the code after the epoch's batch loop (a per-epoch scheduler, evaluation): the run resumed from it
    re-enters that epoch with no batch left, so that code runs again; one taken after it (``save()``,
    ``close()``) continues at the next epoch's first batch.
    """
    epochs, step = divmod(global_step, steps_per_epoch)
    if step == 0 and epochs > 0 and reason in AT_STEP_REASONS:
        return first_epoch + epochs - 1, steps_per_epoch
    return first_epoch + epochs, step


def continue_batches(batches: Iterable[Any], skip: int) -> Iterator[Any]:
    """The batches of ``batches`` after its first ``skip``, with every generator as it was before they were read.

    The uninterrupted run read the skipped batches (and drew the DataLoader's seed) before the state the
    checkpoint restored: reading them again must not move the generators that the training steps then draw
    from (dropout, noise, augmentation in the loop's process), so their states are put back after the skip.
    """
    state = capture_rng_state()
    iterator = iter(batches)
    for _ in range(skip):
        if next(iterator, _END) is _END:
            break
    restore_rng_state(state)
    yield from iterator


_END = object()


def load_files(path: Path) -> dict[str, Any]:
    """Every ``.pt`` file of a complete checkpoint by name, and its manifest as ``"manifest"``."""
    manifest = read_manifest(path)
    loaded = {name: load_file(path / name) for name in manifest["files"] if name.endswith(".pt")}
    loaded["manifest"] = manifest
    return loaded


def restore_objects(
    path: Path,
    objects: dict[str, Any],
    loaded: dict[str, Any],
    per_rank: list[str],
    rank: int,
    restored: tuple[str, ...] = (),
) -> dict[str, Any]:
    """Load every object's state from ``loaded`` (file name -> state); return the Checkpointer's counters.

    A ``per_rank`` object gets this rank's own state; on a rank the
    checkpoint did not have (a larger world size) it keeps its own, and rank 0
    says so. ``restored``: objects restored already (a sharded checkpoint's
    model and optimizer), checked only.

    Raises:
        CheckpointError: the checkpoint holds other objects, or a state does not fit its object.
    """
    manifest = loaded["manifest"]
    saved, given = set(manifest.get("objects", [])), set(objects)
    if saved != given:
        raise CheckpointError(_mismatch(path, saved, given))
    saved_per_rank = manifest.get("per_rank", [])
    if sorted(saved_per_rank) != sorted(per_rank):
        raise CheckpointError(
            f"checkpoint {path} holds per-rank states of {sorted(saved_per_rank) or 'no object'} and this run "
            f"passes per_rank={sorted(per_rank) or '{}'}; pass the same objects as per_rank= as when it was written"
        )
    for name, obj in objects.items():
        if name in restored:
            continue
        state = loaded[f"{name}.pt"]
        if name in per_rank:
            ranks = state["ranks"]
            if rank >= len(ranks):
                if rank == len(ranks):
                    get_logger().warning(
                        f"checkpoint {path.name} holds the per-rank {name} of {len(ranks)} rank(s): rank {rank} and "
                        "above keep their own"
                    )
                continue
            state = ranks[rank]
        try:
            obj.load_state_dict(state)
        except (RuntimeError, ValueError, KeyError, TypeError) as e:
            detail = "; ".join(line.strip() for line in str(e).strip().splitlines() if line.strip())
            raise CheckpointError(
                f"checkpoint {path}: its {name} does not fit this run's {name} ({detail}); resume with the "
                f"settings it was written with, or start a new run in another folder"
            ) from None
    counters: dict[str, Any] = loaded[TRAIN_FILE]
    return counters


def restore_rng(loaded: dict[str, Any], rank: int, global_step: int) -> int:
    """Restore this rank's generators from the checkpoint; return the world size that wrote it."""
    ranks = loaded[RNG_FILE]["ranks"]
    if rank < len(ranks):
        restore_rng_state(ranks[rank])
    else:  # a rank the checkpoint did not have: its own stream, distinct from every other rank's
        seed_everything((global_step * 1_000_003 + rank * 7919) % 2**63)
    return len(ranks)


def _mismatch(path: Path, saved: set[str], given: set[str]) -> str:
    parts = []
    if saved - given:
        parts.append(f"it holds {', '.join(sorted(saved - given))} that this run does not pass")
    if given - saved:
        parts.append(f"this run passes {', '.join(sorted(given - saved))} that it does not hold")
    return (
        f"checkpoint {path} does not match the objects given to the Checkpointer ({'; '.join(parts)}); "
        "pass the same objects it was written with, or start a new run in another folder"
    )


def log_resume(
    path: str | Path,
    *,
    global_step: int,
    resume_point: tuple[int, int],
    first_epoch: int,
    position: LoaderPosition | None,
    epochs_counted: bool,
    finished: bool,
    saved_world_size: int,
    world_size: int,
    steps_per_epoch: int | None = None,
) -> None:
    """Rank 0's lines after a resume: where training continues, and what a new world size changes.

    Epochs are named as the loop numbers them (``set_epoch``, ``first_epoch``);
    a loop without a loader that never called ``epoch_end()`` has no epochs
    to speak of (it samples its batches, e.g. from the restored generators).
    ``steps_per_epoch``: a torch DataLoader's length (``loader=``), which counts the epochs without a position.
    ``path``: the checkpoint as the lines name it (a remote one's URL).
    """
    log = get_logger()
    # An elastic job that lost or gained a node says so in one line; any other change of size, in detail.
    elastic = nodes_change_line(os.environ, saved_world_size, world_size, global_step) if position else ""
    if elastic:
        log.warning(elastic)
    elif saved_world_size != world_size:
        log.warning(world_size_line(Path(path).name, saved_world_size, world_size, position is not None))
    epoch, step = resume_point
    if position is None and steps_per_epoch is not None:
        log.info(_by_length_line(path, global_step, epoch - first_epoch, step, steps_per_epoch, finished))
        return
    complete = epoch - first_epoch  # epochs counted, whatever the loop's numbering
    done = (
        "; the run that wrote it had finished there (Checkpointer.close() after its last step): this run "
        "trains on only if its loop goes further (more epochs or steps; ResumePoint.finished)"
        if finished
        else ""
    )
    if position is None and not epochs_counted:
        # True of any loop: one that samples its own batches has no epochs; one over a DataLoader is told the fix.
        log.info(
            f"resumed from {path} (global step {global_step}){done}; no epochs are counted (no loader=, no "
            "epoch_end()): a loop over the epochs of a DataLoader passes it as loader= to continue at its epoch "
            "and batch"
        )
        return
    if position is None and step:
        log.warning(
            f"resumed from {path} (global step {global_step}: {complete} epoch(s) complete and "
            f"{step} step(s) of the next), without a loader= to continue the data from there: skip "
            f"start.step_in_epoch ({step}) batches of that epoch in the loop, or its first {step} batches "
            "are trained twice; pass loader=ddpkit.DataLoader(...) for an exact resume"
        )
        return
    # Counted, never numbered: a loop numbers its epochs as it likes (from 0, from 1), its log lines too.
    if position is None or step == 0:
        where = f"{complete} epoch(s) complete"
    elif position.streaming:  # a stream's length is known at its end only
        where = f"{complete} epoch(s) complete and {step} step(s) of the next"
    elif step >= position.steps_per_epoch:
        where = (
            f"{complete} epoch(s) complete and all {step} steps of the next: the code after its batch loop runs again"
        )
    else:
        where = f"{complete} epoch(s) complete and {step} of {position.steps_per_epoch} steps of the next"
    log.info(f"resumed from {path} (global step {global_step}: {where}){done}")


def world_size_line(name: str, saved_world_size: int, world_size: int, positioned: bool) -> str:
    """What resuming a checkpoint of ``saved_world_size`` workers with ``world_size`` changes.

    ``positioned``: a ddpkit.DataLoader holds the position, so the global batch and the sample order carry
    over; a loop that draws its own batches (or a torch DataLoader's per-rank ``batch_size``) keeps each rank's
    batch, so the global batch scales with the number of workers, and there is no sample order to continue.
    """
    if positioned:
        return (
            f"checkpoint {name} was written by {saved_world_size} worker(s) and this run has "
            f"{world_size}: training continues at the same global batch of the same sample order "
            "(no sample skipped or repeated), but results are not bit-identical to an uninterrupted run "
            "(per-rank random states and the all_reduce order differ)"
        )
    return (
        f"checkpoint {name} was written by {saved_world_size} worker(s) and this run has {world_size}, "
        "without a ddpkit.DataLoader as loader= to hold the data position: each rank draws batches of the size "
        f"it did, so the global batch is {world_size}/{saved_world_size} of what it was, there is no sample order "
        "to continue, and the ranks' random states differ; results differ from an uninterrupted run (resume with "
        f"{saved_world_size} workers to continue exactly)"
    )


def _by_length_line(path: str | Path, global_step: int, complete: int, step: int, length: int, finished: bool) -> str:
    """Where a loop over a torch DataLoader (``loader=``, counted by its length) continues."""
    if step >= length:
        where = (
            f"{complete} epoch(s) complete and all {length} steps of the next: the code after its batch loop runs again"
        )
    elif step:
        where = (
            f"{complete} epoch(s) complete and {step} of {length} steps of the next: ckpt.enumerate(loader) skips them"
        )
    else:
        where = f"{complete} epoch(s) complete"
    done = "; the run that wrote it had finished there (ResumePoint.finished)" if finished else ""
    return f"resumed from {path} (global step {global_step}: {where}){done}"
