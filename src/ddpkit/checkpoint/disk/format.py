"""Checkpoints on disk: crash-safe writes, a manifest that marks them complete, verified reads.

A checkpoint is one folder, named by the global step it was taken after::

    checkpoints/
      step-000000120/
        model.pt         one file per object given to the Checkpointer: its state_dict
        optimizer.pt     (model, optimizer, scheduler, scaler, loader, extras)
        train.pt         global step and completed epochs
        rng.pt           every rank's RNG states (Python, NumPy, torch CPU, each CUDA device)
        config.yaml      the resolved config, for people
        manifest.json    written last: size and SHA-256 of every file, step, epoch, metrics,
                         world size, library versions. No manifest: not a checkpoint.
      step-000000240/
      best-000000120/    the best checkpoint so far (hard links to the files of step-000000120)

How a write cannot corrupt (one writer: rank 0):

1. each file goes to a temporary name in the checkpoint's own folder, created
   private to the user (``readable_by``), is fsynced, then renamed over its
   final name (rename is atomic within one file system);
2. the folder is fsynced, so the renames are on disk;
3. ``manifest.json`` is written the same way, then the folder and its parent
   are fsynced. A crash at any point leaves either no manifest (the folder is
   an incomplete leftover, never loaded) or a complete one.

Only then are older checkpoints deleted, counting complete ones only (and of
those, none whose manifest says its weights are not finite: see
:mod:`ddpkit.checkpoint.disk.finite`), so the last ``keep`` complete checkpoints
always exist.

Nothing that may be data is deleted on a guess: a folder without a manifest
(an interrupted write, or a copy or sync still in progress) and a folder that
cannot be read are renamed aside (:func:`set_aside`: ``step-....incomplete``,
``.unreadable``, ``.corrupt``), never removed.

Reads trust nothing: :func:`verify_checkpoint` checks every file's size and
SHA-256 against the manifest and loads it with ``torch.load(weights_only=True)``
(tensors and plain containers only, never arbitrary pickled objects; there is
no fallback to an unsafe load), so a truncated file, a bit flip or a crafted
pickle is found before anything is restored.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import shutil
import time
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, BinaryIO

import torch

from ddpkit.checkpoint.disk.layout import (
    BEST_PREFIX,
    CORRUPT_SUFFIX,
    FORMAT,
    INCOMPLETE_SUFFIX,
    MANIFEST,
    NAME_PATTERN,
    STEP_PREFIX,
    UNREADABLE_SUFFIX,
    CheckpointError,
    checkpoint_name,
    folder_mode,
)
from ddpkit.checkpoint.disk.reading import (
    CheckpointInfo,
    checkpoint_digest,
    has_manifest,
    list_checkpoints,
    load_file,
    read_manifest,
    unreadable_message,
    verify_checkpoint,
)
from ddpkit.version import __version__

__all__ = [  # the reading side and the layout are re-exported: the format's one import for its users
    "BEST_PREFIX",
    "CORRUPT_SUFFIX",
    "FORMAT",
    "INCOMPLETE_SUFFIX",
    "MANIFEST",
    "STEP_PREFIX",
    "UNREADABLE_SUFFIX",
    "CheckpointError",
    "CheckpointInfo",
    "checkpoint_digest",
    "checkpoint_name",
    "finish_checkpoint",
    "folder_mode",
    "has_manifest",
    "library_versions",
    "list_checkpoints",
    "load_file",
    "mark_best",
    "prune",
    "read_manifest",
    "resolve_checkpoint_dir",
    "rewrite_manifest",
    "set_aside",
    "unreadable_message",
    "verify_checkpoint",
    "write_checkpoint",
    "write_file_atomic",
]


# -- writing ------------------------------------------------------------------


class _HashingFile:
    """A write-only file object that hashes and counts what passes through it."""

    def __init__(self, raw: BinaryIO):
        self.raw = raw
        self.sha256 = hashlib.sha256()
        self.size = 0
        self.error: OSError | None = None
        """The OSError a write raised (torch.save reports it as an unrelated RuntimeError)."""

    def write(self, data: bytes) -> int:
        self.sha256.update(data)
        self.size += len(data)
        try:
            return self.raw.write(data)
        except OSError as e:
            self.error = e
            raise

    def flush(self) -> None:
        self.raw.flush()


def _fsync_folder(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file_atomic(folder: Path, name: str, write: Callable[[Any], None], mode: int = 0o600) -> dict[str, Any]:
    """Write ``folder/name`` through a temporary file, fsync and atomic rename.

    Args:
        folder: the destination folder (the temporary file lives there too, so
            the rename stays within one file system).
        name: the final file name.
        write: called with a binary file object to write the contents.
        mode: permission bits of the file, applied whatever the umask.

    Returns:
        ``{"bytes": size, "sha256": hex digest}`` of what was written.

    Raises:
        OSError: the file could not be written (no space, read-only, the folder vanished...), also
            where the failed write happened inside ``write`` and surfaced as another exception.
    """
    tmp = folder / f".{name}.tmp-{uuid.uuid4().hex[:8]}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    hashing: _HashingFile | None = None
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as raw:
            fd = -1
            hashing = _HashingFile(raw)
            write(hashing)
            raw.flush()
            os.fsync(raw.fileno())
        os.replace(tmp, folder / name)
    except BaseException as e:
        if fd >= 0:
            os.close(fd)
        tmp.unlink(missing_ok=True)
        if hashing is not None and hashing.error is not None and not isinstance(e, OSError):
            raise hashing.error from None  # e.g. torch.save's "unexpected pos" hiding "No space left on device"
        raise
    return {"bytes": hashing.size, "sha256": hashing.sha256.hexdigest()}


def write_checkpoint(
    root: str | Path,
    name: str,
    objects: Mapping[str, Any],
    texts: Mapping[str, str],
    meta: Mapping[str, Any],
    mode: int = 0o600,
) -> Path:
    """Write one complete checkpoint folder ``root/name`` (see the module docstring for the steps).

    Args:
        root: the checkpoints folder (created if missing).
        name: the checkpoint's folder name, e.g. ``checkpoint_name(step)``.
        objects: file name -> object for ``torch.save`` (tensors and plain containers).
        texts: file name -> text, written as UTF-8.
        meta: JSON-serialisable facts stored in the manifest (step, epoch, metrics...).
        mode: permission bits of the files (folders get matching search bits).

    Returns:
        The path of the complete checkpoint.

    Raises:
        OSError: a file or folder could not be written; the incomplete folder is removed first.
    """
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True, mode=folder_mode(mode))
    final = root / name
    replacing = (final / MANIFEST).exists()
    # A complete checkpoint of the same step (the state changed since: see Checkpointer.save) is replaced
    # only once its successor is complete, written aside; a folder of that name without a manifest (a
    # crash's leftover, or a copy in progress) is renamed aside, never removed.
    folder = root / f".{name}.tmp-{uuid.uuid4().hex[:8]}" if replacing else final
    if not replacing and folder.exists():
        set_aside(folder, INCOMPLETE_SUFFIX)
    folder.mkdir(mode=folder_mode(mode))
    try:
        _write_folder(folder, name, objects, texts, meta, mode)
    except OSError:
        shutil.rmtree(folder, ignore_errors=True)  # what a failed write left: no manifest, never loaded
        raise
    if replacing:
        _swap_in(folder, final)
    _fsync_folder(root)
    return final


def finish_checkpoint(
    root: str | Path,
    folder: Path,
    name: str,
    objects: Mapping[str, Any],
    texts: Mapping[str, str],
    meta: Mapping[str, Any],
    written: Mapping[str, Mapping[str, Any]],
    mode: int = 0o600,
) -> Path:
    """Complete a checkpoint whose other files are already in the hidden folder ``folder`` (a sharded write).

    Like :func:`write_checkpoint`, with ``written`` (file name -> size and SHA-256: the files others wrote
    into ``folder``, fsynced) listed in the manifest: the objects and texts, the manifest last, then the
    folder is renamed to ``root/name`` (replacing a complete checkpoint of the same step as
    :func:`write_checkpoint` does).

    Raises:
        OSError: a file could not be written or the folder renamed; ``folder`` is removed first.
    """
    root = Path(root)
    final = root / name
    try:
        _write_folder(folder, name, objects, texts, meta, mode, written)
        if (final / MANIFEST).exists():
            _swap_in(folder, final)
        else:
            if final.exists():  # a folder of that name without a manifest: set aside, as write_checkpoint does
                set_aside(final, INCOMPLETE_SUFFIX)
            os.rename(folder, final)
    except OSError:
        shutil.rmtree(folder, ignore_errors=True)
        raise
    _fsync_folder(root)
    return final


def _write_folder(
    folder: Path,
    name: str,
    objects: Mapping[str, Any],
    texts: Mapping[str, str],
    meta: Mapping[str, Any],
    mode: int,
    written: Mapping[str, Mapping[str, Any]] | None = None,
) -> None:
    """Write the files of ``folder`` (created) for checkpoint ``name``, then its manifest; see
    :func:`write_checkpoint` (``written``: files already there, see :func:`finish_checkpoint`)."""
    os.chmod(folder, folder_mode(mode))
    files: dict[str, dict[str, Any]] = {file: dict(facts) for file, facts in (written or {}).items()}
    for file_name, obj in objects.items():
        files[file_name] = write_file_atomic(folder, file_name, functools.partial(torch.save, obj), mode)
    for file_name, text in texts.items():
        files[file_name] = write_file_atomic(folder, file_name, functools.partial(_write_bytes, text.encode()), mode)
    _fsync_folder(folder)
    manifest = {"format": FORMAT, "name": name, "created": time.time(), **meta, "files": files}
    text = json.dumps(manifest, indent=2, sort_keys=True) + "\n"
    write_file_atomic(folder, MANIFEST, lambda f: f.write(text.encode()), mode)
    _fsync_folder(folder)


def _write_bytes(data: bytes, file: BinaryIO) -> None:
    file.write(data)


def _swap_in(new: Path, final: Path) -> None:
    """Put the complete folder ``new`` at ``final``, where a complete checkpoint is.

    Two renames: a crash between them leaves the step's checkpoint only under
    hidden names, and the newest complete one before it is resumed (exactly).
    """
    old = final.with_name(f".{final.name}.old-{uuid.uuid4().hex[:8]}")
    os.rename(final, old)
    os.rename(new, final)
    shutil.rmtree(old, ignore_errors=True)


def rewrite_manifest(folder: str | Path, updates: Mapping[str, Any], mode: int = 0o600) -> dict[str, Any]:
    """Replace top-level facts of a complete checkpoint's manifest (e.g. metrics known after the save).

    The files and their checksums are left as they are; the new manifest
    replaces the old one atomically, so the checkpoint is complete throughout.
    """
    folder = Path(folder)
    manifest = {**read_manifest(folder), **updates}
    text = json.dumps(manifest, indent=2, sort_keys=True) + "\n"
    write_file_atomic(folder, MANIFEST, lambda f: f.write(text.encode()), mode)
    _fsync_folder(folder)
    return manifest


def library_versions() -> dict[str, str]:
    """Versions of the libraries a checkpoint depends on, stored in its manifest."""
    import numpy

    return {
        "ddpkit": __version__,
        "torch": torch.__version__,
        "numpy": numpy.__version__,
        "python": platform.python_version(),
    }


def mark_best(root: str | Path, checkpoint: str | Path, mode: int = 0o600) -> Path:
    """Make ``checkpoint`` the ``best-<step>`` checkpoint of ``root``, then delete older best ones.

    The files are hard links (copies where the file system has none): no data
    is written twice, and deleting the step folder later leaves the best one whole.
    """
    root, checkpoint = Path(root), Path(checkpoint)
    named = NAME_PATTERN.match(checkpoint.name)
    assert named is not None, f"{checkpoint} is not a checkpoint folder written by write_checkpoint"
    step = int(named.group(2))
    target = root / f"{BEST_PREFIX}{step:09d}"
    if target.exists():
        shutil.rmtree(target)
    staging = root / f".{target.name}.tmp-{uuid.uuid4().hex[:8]}"
    staging.mkdir(mode=folder_mode(mode))
    os.chmod(staging, folder_mode(mode))
    # The manifest last, so the best folder is complete only once all its files are there. Hidden files
    # are a crash's temporary files, unless the manifest lists them (a sharded checkpoint's .metadata).
    listed = set(read_manifest(checkpoint)["files"])
    names = sorted(p.name for p in checkpoint.iterdir() if not p.name.startswith(".") or p.name in listed)
    for file_name in sorted(names, key=lambda n: n == MANIFEST):
        try:
            os.link(checkpoint / file_name, staging / file_name)
        except OSError:
            shutil.copy2(checkpoint / file_name, staging / file_name)
    _fsync_folder(staging)
    os.rename(staging, target)
    _fsync_folder(root)
    for info in list_checkpoints(root, prefix=BEST_PREFIX):
        if info.path != target:
            shutil.rmtree(info.path, ignore_errors=True)
    return target


# -- retention ----------------------------------------------------------------


def prune(root: str | Path, keep: int, protect: Path | None = None) -> list[Path]:
    """Delete all but the newest ``keep`` complete, finite, readable checkpoints.

    Only those count toward ``keep`` and only those are deleted: a checkpoint
    whose manifest marks its weights non-finite (``"finite": false``, see
    :mod:`ddpkit.checkpoint.disk.finite`) never pushes a finite one out, and a folder
    without a manifest or that cannot be read is left where it is (it may be a
    copy in progress; a resume sets it aside).

    Args:
        root: the checkpoints folder.
        keep: number of complete checkpoints to keep (>= 1).
        protect: a folder never deleted (the one just written).

    Returns:
        The deleted folders.
    """
    infos = list_checkpoints(root)
    for hidden in Path(root).glob(f".{STEP_PREFIX}*"):  # aside-written or replaced folders a crash left behind
        shutil.rmtree(hidden, ignore_errors=True)
    counted = [info for info in infos if info.manifest is not None and info.finite]
    kept = {info.path for info in counted[-keep:]} | ({protect} if protect else set())
    deleted = []
    for info in counted:
        if info.path not in kept:
            shutil.rmtree(info.path, ignore_errors=True)
            deleted.append(info.path)
    return deleted


def set_aside(folder: Path, suffix: str = CORRUPT_SUFFIX) -> Path:
    """Rename a checkpoint folder to ``<name><suffix>`` (kept for inspection, never loaded again).

    The suffixes say why: ``.corrupt`` (a file fails its checksum or the safe load), ``.incomplete``
    (no manifest), ``.unreadable`` (permissions), ``.nonfinite`` (NaN or infinite weights).
    """
    target = folder.with_name(folder.name + suffix)
    n = 1
    while target.exists():
        n += 1
        target = folder.with_name(f"{folder.name}{suffix}{n}")
    os.rename(folder, target)
    return target


def resolve_checkpoint_dir(path: str | Path) -> Path:
    """The checkpoints folder for ``path``: itself, or ``path/checkpoints`` when that exists (an output_dir)."""
    path = Path(path)
    if not list_checkpoints(path) and (path / "checkpoints").is_dir():
        return path / "checkpoints"
    return path
