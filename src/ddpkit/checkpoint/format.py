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
:mod:`ddpkit.checkpoint.finite`), so the last ``keep`` complete checkpoints
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
import io
import json
import os
import pickle
import platform
import re
import shutil
import stat
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import torch

from ddpkit.errors import UserError
from ddpkit.version import __version__

FORMAT = "ddpkit-checkpoint/2"
"""Value of the manifest's ``format`` key."""
MANIFEST = "manifest.json"
STEP_PREFIX = "step-"
BEST_PREFIX = "best-"
CORRUPT_SUFFIX = ".corrupt"
INCOMPLETE_SUFFIX = ".incomplete"
UNREADABLE_SUFFIX = ".unreadable"
_NAME = re.compile(r"^(step|best)-(\d{9,})$")
_CHUNK = 1 << 20


class CheckpointError(UserError):
    """A checkpoint is missing, incomplete, corrupt or refused; the message names the file and the fix."""


def checkpoint_name(global_step: int) -> str:
    """The folder name of the checkpoint taken after ``global_step`` steps."""
    return f"{STEP_PREFIX}{global_step:09d}"


def folder_mode(file_mode: int) -> int:
    """The folder mode for ``file_mode``: every read permission also gets search permission."""
    return file_mode | ((file_mode & 0o444) >> 2)


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
            if final.exists():  # an incomplete leftover of a crashed write of this step
                shutil.rmtree(final)
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
    named = _NAME.match(checkpoint.name)
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


# -- finding and verifying ----------------------------------------------------


@dataclass(frozen=True)
class CheckpointInfo:
    """A checkpoint folder as found on disk (complete or not)."""

    path: Path
    """The folder."""
    global_step: int
    """The step in its name."""
    manifest: dict[str, Any] | None = field(default=None, compare=False)
    """The parsed manifest, or None when the folder has none (an incomplete write)."""
    problem: str = ""
    """Why the manifest could not be read, if it exists but is unreadable."""

    unreadable: bool = False
    """True when the folder or its manifest cannot be read (permissions, I/O error): ``problem`` says why."""

    @property
    def complete(self) -> bool:
        """True when a manifest marks the write as finished (or one is there but cannot be read)."""
        return self.manifest is not None or bool(self.problem)

    @property
    def finite(self) -> bool:
        """False when the manifest says the checkpoint's tensors hold NaN or infinity (``"finite": false``)."""
        return not (self.manifest and self.manifest.get("finite", True) is False)

    @property
    def size(self) -> int:
        """Bytes of all its files, as listed by the manifest (on-disk size without one)."""
        if self.manifest:
            listed = sum(int(f["bytes"]) for f in self.manifest.get("files", {}).values())
            return listed + _file_size(self.path / MANIFEST)
        try:
            return sum(_file_size(p) for p in self.path.iterdir())
        except OSError:
            return 0


def _file_size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def read_manifest(folder: str | Path) -> dict[str, Any]:
    """The parsed manifest of a checkpoint folder.

    Raises:
        CheckpointError: no such folder, no manifest (the write never finished), or an unreadable one.
    """
    try:
        is_folder = _is_dir(Path(folder))
    except OSError as e:  # a parent that cannot be searched
        raise CheckpointError(unreadable_message(Path(folder), e)) from None
    if not is_folder:
        raise CheckpointError(f"checkpoint {folder} does not exist; pass a checkpoint folder (e.g. .../step-000000120)")
    path = Path(folder) / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(
            f"{folder} is not a complete checkpoint: it has no {MANIFEST} "
            "(its write never finished, or a copy of it is still in progress); use an earlier checkpoint"
        ) from None
    except PermissionError as e:
        raise CheckpointError(unreadable_message(Path(folder), e)) from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path} is damaged ({e}); use an earlier checkpoint") from None
    if (
        not isinstance(manifest, dict)
        or manifest.get("format") != FORMAT
        or not isinstance(manifest.get("files"), dict)
    ):
        raise CheckpointError(f"{path} is not a {FORMAT} manifest; use a checkpoint written by this ddpkit version")
    return manifest


def unreadable_message(folder: Path, error: OSError) -> str:
    """One line for a checkpoint folder (or its manifest) that cannot be read."""
    reason = error.strerror or type(error).__name__
    return (
        f"checkpoint {folder} cannot be read ({reason}); make it readable by this user (chmod, chown), "
        "or use an earlier checkpoint"
    )


def has_manifest(folder: str | Path) -> bool:
    """True when ``folder`` holds a manifest; a folder that cannot be read says so (CheckpointError), in one line."""
    try:
        return (Path(folder) / MANIFEST).exists()
    except OSError as e:
        raise CheckpointError(unreadable_message(Path(folder), e)) from None


def _is_dir(path: Path) -> bool:
    try:
        return stat.S_ISDIR(path.stat().st_mode)
    except (FileNotFoundError, NotADirectoryError):
        return False


def list_checkpoints(root: str | Path, prefix: str = STEP_PREFIX) -> list[CheckpointInfo]:
    """The checkpoint folders of ``root`` named ``<prefix><step>``, oldest first.

    Incomplete folders (no manifest) are listed too, with ``manifest=None``; a
    folder that cannot be read is listed with ``unreadable=True`` and its
    ``problem``, never raised (one bad folder must not hide the good ones).

    Raises:
        CheckpointError: ``root`` itself exists but cannot be read.
    """
    root = Path(root)
    try:
        if not _is_dir(root):
            return []
        entries = list(root.iterdir())
    except OSError as e:
        raise CheckpointError(
            f"checkpoints folder {root} cannot be read ({e.strerror or type(e).__name__}); "
            "make it readable by this user (chmod, chown)"
        ) from None
    found = []
    for path in entries:
        match = _NAME.match(path.name)
        if not match or not path.name.startswith(prefix):
            continue
        manifest, problem, unreadable = None, "", False
        try:
            if not _is_dir(path):
                continue
            has_manifest = (path / MANIFEST).exists()
        except OSError as e:
            has_manifest, problem, unreadable = False, unreadable_message(path, e), True
        if has_manifest:
            try:
                manifest = read_manifest(path)
            except CheckpointError as e:
                problem = str(e)
                unreadable = "cannot be read" in problem
        found.append(CheckpointInfo(path, int(match.group(2)), manifest, problem, unreadable))
    return sorted(found, key=lambda info: info.global_step)


def load_file(path: str | Path, map_location: str | torch.device | None = "cpu", data: bytes | None = None) -> Any:
    """``torch.load(path, weights_only=True)``, with errors that name the file and the fix.

    Args:
        path: the file.
        map_location: where tensors go (the optimizer's state follows its parameters anyway).
        data: the file's bytes, when already read (to load exactly what was checksummed).

    Raises:
        CheckpointError: the file is missing, damaged, or holds anything but
            tensors and plain containers (a pickle that would run code is refused, never executed).
    """
    try:
        source = io.BytesIO(data) if data is not None else path
        return torch.load(source, map_location=map_location, weights_only=True)
    except FileNotFoundError:
        raise CheckpointError(f"{path} does not exist; pass an existing checkpoint") from None
    except PermissionError as e:
        raise CheckpointError(
            f"{path} cannot be read ({e.strerror or e}); make it readable by this user (chmod, chown)"
        ) from None
    except pickle.UnpicklingError as e:
        reason = _unpickling_reason(str(e))
        raise CheckpointError(
            f"refused to load {path}: it holds objects other than tensors and plain containers "
            f"({reason}); ddpkit loads only weights_only=True files and never runs code from a checkpoint. "
            "Use a checkpoint written by ddpkit, or re-save plain tensors from a source you trust"
        ) from None
    except (RuntimeError, OSError, EOFError, ValueError) as e:
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"{path} is damaged and cannot be loaded ({reason}); use an earlier checkpoint") from None


def _unpickling_reason(text: str) -> str:
    """What torch's refusal says the file holds (e.g. "Unsupported global: GLOBAL posix.system"), without its
    advice to load with weights_only=False, which would run the code ddpkit refuses."""
    lines = [re.sub(r"\x1b\[[0-9;]*m", "", line).strip() for line in text.splitlines()]
    for line in lines:
        if "GLOBAL" in line or "Unpickler error" in line:
            reason = line.split("Unpickler error:", 1)[-1].split(". Please use")[0].strip()
            return reason.removeprefix("Trying to load ").rstrip(".")
    for line in lines:
        if line and "weights_only" not in line and not line.startswith(("Weights only load failed", "Check the")):
            return line.rstrip(".")
    return "unsupported content"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def verify_checkpoint(folder: str | Path, load: bool = True) -> dict[str, Any]:
    """Check a checkpoint completely; return the loaded ``.pt`` files by name (and ``"manifest"``).

    Args:
        folder: the checkpoint folder.
        load: also load every ``.pt`` file with ``weights_only=True`` (refusing
            crafted pickles); without it only sizes and checksums are checked.

    Raises:
        CheckpointError: no manifest, a file missing, truncated or changed
            (size or SHA-256), or refused by the safe loader. The message names the file.
    """
    folder = Path(folder)
    manifest = read_manifest(folder)
    loaded: dict[str, Any] = {"manifest": manifest}
    for name, expected in manifest["files"].items():
        try:
            loaded.update(_verify_file(folder / name, name, expected, load))
        except OSError as e:  # e.g. a file of mode 000: named, never a traceback
            raise CheckpointError(
                f"{folder / name} cannot be read ({e.strerror or type(e).__name__}); make it readable by this "
                "user (chmod, chown), or use an earlier checkpoint"
            ) from None
    return loaded


def _verify_file(path: Path, name: str, expected: Mapping[str, Any], load: bool) -> dict[str, Any]:
    """Check one file of a checkpoint against its manifest entry; its loaded contents by name when ``load``."""
    size = _file_size(path) if path.exists() else None
    if size is None:
        raise CheckpointError(f"{path} is missing; the checkpoint is incomplete; use an earlier checkpoint")
    if size != expected["bytes"]:
        raise CheckpointError(
            f"{path} is truncated or damaged: {size} bytes on disk, "
            f"{expected['bytes']} in the manifest; use an earlier checkpoint"
        )
    # .pt files are read once: the bytes checksummed are the bytes loaded.
    data = path.read_bytes() if load and name.endswith(".pt") else None
    digest = hashlib.sha256(data).hexdigest() if data is not None else _sha256(path)
    if digest != expected["sha256"]:
        raise CheckpointError(f"{path} is damaged: its SHA-256 does not match the manifest; use an earlier checkpoint")
    return {name: load_file(path, data=data)} if data is not None else {}


# -- retention ----------------------------------------------------------------


def prune(root: str | Path, keep: int, protect: Path | None = None) -> list[Path]:
    """Delete all but the newest ``keep`` complete, finite, readable checkpoints.

    Only those count toward ``keep`` and only those are deleted: a checkpoint
    whose manifest marks its weights non-finite (``"finite": false``, see
    :mod:`ddpkit.checkpoint.finite`) never pushes a finite one out, and a folder
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
