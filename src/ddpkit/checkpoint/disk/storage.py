"""Storage faults of checkpoint writes: one line naming the folder, the room there and the fix.

A save fails when the file system is full (``ENOSPC``) or a quota is
reached (``EDQUOT``), when the folder is read-only or not the user's
(``EROFS``, ``EACCES``), or when it vanished (unmounted, deleted). torch.save
reports a full disk as an unrelated ``RuntimeError`` ("unexpected pos");
:func:`ddpkit.checkpoint.disk.format.write_file_atomic` (and, for a sharded
checkpoint's shards, :class:`ddpkit.checkpoint.sharded.state.ShardedState`) hands
on the ``OSError`` underneath, and :func:`ddpkit.checkpoint.disk.format.write_checkpoint` removes the
incomplete folder. What the Checkpointer then says is built here::

    cannot write checkpoint runs/a/checkpoints/step-000002814: No space left on device (12.0 kB free on the
    file system of runs/a/checkpoints, a checkpoint needs about 158.6 kB); the incomplete step-000002814 was
    removed; the newest complete checkpoint runs/a/checkpoints/step-000001876 is untouched; free at least
    146.6 kB there, keep fewer checkpoints (keep / checkpoint.keep) or write them to another folder
    (dir / checkpoint.dir), then continue with resume=auto

The write then stops training with :data:`EXIT_STORAGE` (74), or, where the
user chose ``on_write_error="warn"``, training goes on with that line as a
warning. Before training, :func:`room_warning` says when the folder cannot
hold ``keep + 1`` checkpoints (the kept ones and the one being written).
"""

from __future__ import annotations

import errno
import io
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ddpkit.checkpoint.disk.format import CheckpointError, list_checkpoints
from ddpkit.checkpoint.objects import is_collective
from ddpkit.checkpoint.rng import capture_rng_state
from ddpkit.names import EXIT_STORAGE

FILE_OVERHEAD = 4096
"""Bytes counted per file beyond its tensors: torch.save's archive (about 1.3 kB) and the file system's last block."""

_NO_ROOM = (errno.ENOSPC, errno.EDQUOT)
_NOT_WRITABLE = (errno.EROFS, errno.EACCES, errno.EPERM)


class StorageError(CheckpointError):
    """A checkpoint could not be written (no space, quota, read-only or vanished folder)."""

    exit_status = EXIT_STORAGE
    """The exit status of a worker and of the command that stop on it."""


def format_bytes(size: float) -> str:
    """``size`` in bytes as people read it: 512 B, 158.6 kB, 1.4 MB, 2.0 GB."""
    for unit in ("B", "kB", "MB", "GB"):
        if abs(size) < 1000 or unit == "GB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1000
    raise AssertionError("unreachable")


def free_bytes(folder: Path) -> int:
    """Bytes free for this user on the file system that holds ``folder`` (or would: its nearest existing parent)."""
    path = folder.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


def checkpoint_bytes(root: Path, objects: Mapping[str, Any], world_size: int) -> int:
    """The expected size of one checkpoint: the newest complete one's, else an estimate from ``objects``."""
    complete = [info for info in list_checkpoints(root) if info.manifest is not None]
    return complete[-1].size if complete else estimate_bytes(objects, world_size)


def estimate_bytes(objects: Mapping[str, Any], world_size: int) -> int:
    """The size of a checkpoint of ``objects`` written by ``world_size`` ranks, before any is written.

    The tensors of every ``state_dict()``, every rank's RNG states, and
    :data:`FILE_OVERHEAD` per file. An optimizer that has not stepped yet
    holds no state: it is counted as two tensors per parameter, as Adam and
    AdamW keep (an upper bound for SGD).
    """
    rng = io.BytesIO()
    torch.save(capture_rng_state(), rng)
    total = world_size * len(rng.getvalue()) + (len(objects) + 4) * FILE_OVERHEAD  # + train, rng, config, manifest
    for obj in objects.values():
        if is_collective(obj):
            continue  # a stream's position: every rank would have to call it, and it holds no tensors
        total += _tensor_bytes(obj.state_dict())
        if isinstance(obj, torch.optim.Optimizer) and not obj.state:
            total += 2 * sum(p.numel() * p.element_size() for group in obj.param_groups for p in group["params"])
    return total


def _tensor_bytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, Mapping):
        return sum(_tensor_bytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_tensor_bytes(v) for v in value)
    return 0


def explain_write_error(root: Path, name: str, error: OSError, needed: int) -> str:
    """One line: which checkpoint could not be written and why, the room there, what is safe, and the fix."""
    reason = error.strerror or str(error)
    free = free_bytes(root)
    complete = [info for info in list_checkpoints(root) if info.manifest is not None]
    removed = f"the incomplete {name} was removed"
    if complete and complete[-1].path.name == name:
        # A rewrite of a step already saved (see Checkpointer.save): its earlier, complete copy is untouched.
        removed = f"the incomplete new copy of {name} was removed"
        newest = f"the complete {name} written earlier is untouched"
    elif complete:
        newest = f"the newest complete checkpoint {complete[-1].path} is untouched"
    else:
        newest = "no complete checkpoint exists yet"
    return (
        f"cannot write checkpoint {root / name}: {reason} ({format_bytes(free)} free on the file system of "
        f"{root}, a checkpoint needs about {format_bytes(needed)}); {removed}; "
        f"{newest}; {_fix(root, error, max(needed - free, 0))}"
    )


def _fix(root: Path, error: OSError, short: int) -> str:
    then = "then continue with resume=auto"
    if error.errno in _NO_ROOM:
        # Room enough now: a quota, or another writer that filled the file system and freed it since.
        room = f"free at least {format_bytes(short)} there" if short else "free space there (or raise your quota)"
        return (
            f"{room}, keep fewer checkpoints (keep / checkpoint.keep) or write them to another folder "
            f"(dir / checkpoint.dir), {then}"
        )
    if error.errno in _NOT_WRITABLE:
        return (
            f"make {root} writable by this user or write checkpoints to another folder (dir / checkpoint.dir), {then}"
        )
    if error.errno == errno.ENOENT:
        return (
            f"{root} vanished (removed or unmounted): restore it or write checkpoints to another folder "
            f"(dir / checkpoint.dir), {then}"
        )
    return f"check the storage of {root} (errno {error.errno}), {then}"


def room_warning(root: Path, keep: int, needed: int) -> str:
    """A warning when ``root`` cannot hold ``keep + 1`` checkpoints of ``needed`` bytes; "" when it can.

    The checkpoints already there count as room: newer ones replace them.
    """
    existing = sum(info.size for info in list_checkpoints(root) if info.manifest is not None)
    free = free_bytes(root)
    wanted = (keep + 1) * needed
    if free + existing >= wanted:
        return ""
    return (
        f"checkpoint folder {root} has {format_bytes(free)} free (plus {format_bytes(existing)} of checkpoints), "
        f"but keeping {keep} checkpoint(s) of about {format_bytes(needed)} while writing the next needs "
        f"{format_bytes(wanted)}: a save will fail for lack of space; free space there, keep fewer checkpoints "
        "(keep / checkpoint.keep) or write them to another folder (dir / checkpoint.dir)"
    )
