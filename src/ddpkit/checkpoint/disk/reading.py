"""Finding checkpoints on disk and reading them without trusting them.

:func:`list_checkpoints` finds a folder's checkpoints (complete or not, readable or not);
:func:`verify_checkpoint` checks every file's size and SHA-256 against the manifest and loads it with
``torch.load(weights_only=True)`` (tensors and plain containers only, never arbitrary pickled objects;
no fallback to an unsafe load), so a truncated file, a bit flip or a crafted pickle is found before
anything is restored. The format itself is described in :mod:`ddpkit.checkpoint.disk.format`.
"""

from __future__ import annotations

import hashlib
import io
import json
import pickle
import re
import stat
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ddpkit.checkpoint.disk.layout import (
    FORMAT,
    MANIFEST,
    NAME_PATTERN,
    SHARDED_KEY,
    STEP_PREFIX,
    CheckpointError,
)

_CHUNK = 1 << 20

# -- finding and verifying ----------------------------------------------------


class ManifestFacts:
    """What a listed checkpoint's manifest says, wherever the checkpoint is (a folder, or a URL in a store)."""

    manifest: dict[str, Any] | None
    problem: str

    @property
    def complete(self) -> bool:
        """True when a manifest marks the write as finished (or one is there but cannot be read)."""
        return self.manifest is not None or bool(self.problem)

    @property
    def finite(self) -> bool:
        """False when the manifest says the checkpoint's tensors hold NaN or infinity (``"finite": false``)."""
        return not (self.manifest and self.manifest.get("finite", True) is False)


@dataclass(frozen=True)
class CheckpointInfo(ManifestFacts):
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
    for name, facts in manifest["files"].items():
        # A plain file name: one with a separator or ".." would have a file outside the folder read (and loaded).
        if name in ("", ".", "..") or Path(name).name != name or "\\" in name:
            raise CheckpointError(
                f"{path} is damaged: it lists the file {name!r}, outside the checkpoint's folder; "
                "use an earlier checkpoint"
            )
        if not (
            isinstance(facts, dict) and isinstance(facts.get("bytes"), int) and isinstance(facts.get("sha256"), str)
        ):
            raise CheckpointError(
                f"{path} is damaged: its entry for {name} has no size and SHA-256; use an earlier checkpoint"
            )
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
        match = NAME_PATTERN.match(path.name)
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
        if reason.startswith("Unsupported operand"):  # not a pickle at all: bytes torch.save never writes
            raise CheckpointError(
                f"{path} is not a file torch.save wrote ({reason}): damaged, or of another format; pass a "
                "checkpoint, an export or a .pt file of a state_dict, or use an earlier checkpoint"
            ) from None
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
    for i, line in enumerate(lines):
        if "GLOBAL" in line or "Unpickler error" in line:
            reason = line.split("Unpickler error:", 1)[-1].split(". Please use")[0].strip()
            if not reason:  # the reason on a line of its own ("Unsupported operand 103")
                reason = next((later for later in lines[i + 1 :] if later), "")
            return reason.removeprefix("Trying to load ").rstrip(".")
    for line in lines:
        if line and "weights_only" not in line and not line.startswith(("Weights only load failed", "Check the")):
            return line.rstrip(".")
    return "unsupported content"


def file_sha256(path: Path) -> str:
    """The SHA-256 of a file (hex), read in chunks: memory bounded whatever its size."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def checkpoint_digest(manifest: Mapping[str, Any]) -> str:
    """The digest of a checkpoint's contents: the SHA-256 of its files' names, sizes and SHA-256, as its
    manifest lists them (64 hex digits).

    It covers every byte a resume, an export or ``init_from`` reads (the DCP index of a sharded checkpoint
    may name no other file), and none of the manifest's other facts (metrics added after the save, the time
    of writing): a ``best-*`` checkpoint has its step's digest. Kept where the checkpoint's folder cannot be
    written, it shows that the checkpoint is the one written then (:func:`verify_checkpoint`'s ``digest``).
    """
    entries = sorted([name, int(facts["bytes"]), str(facts["sha256"])] for name, facts in manifest["files"].items())
    return hashlib.sha256(json.dumps([FORMAT, entries], separators=(",", ":")).encode()).hexdigest()


def verify_checkpoint(folder: str | Path, load: bool = True, digest: str | None = None) -> dict[str, Any]:
    """Check a checkpoint completely; return the loaded ``.pt`` files by name (and ``"manifest"``).

    Args:
        folder: the checkpoint folder.
        load: also load every ``.pt`` file with ``weights_only=True`` (refusing
            crafted pickles); without it only sizes and checksums are checked.
        digest: the checkpoint's :func:`checkpoint_digest` as recorded when it was written (its log line,
            ``ddpkit checkpoints``), kept elsewhere: the checkpoint must match it. The manifest's own
            checksums catch accidents (bit flips, truncation, missing files, interrupted copies), not
            tampering: whoever can write the folder can rewrite them.

    A sharded checkpoint's DCP index is checked against its files too
    (:func:`ddpkit.checkpoint.disk.sharded_reading.check_index`): every slice in a
    file of the manifest, inside the folder, and with ``load`` loadable.

    Raises:
        CheckpointError: no manifest, a file missing, truncated or changed
            (size or SHA-256), or refused by the safe loader; a DCP index that
            does not match its files; a ``digest`` it does not match. The message names the file.
    """
    folder = Path(folder)
    manifest = read_manifest(folder)
    if digest is not None and checkpoint_digest(manifest) != digest.strip().lower():
        raise CheckpointError(
            f"checkpoint {folder} does not match the digest {digest.strip()}: its digest is "
            f"{checkpoint_digest(manifest)}; it was changed since that digest was recorded, or the digest is "
            "another checkpoint's: do not use it; restore it from a copy you trust"
        )
    loaded: dict[str, Any] = {"manifest": manifest}
    for name, expected in manifest["files"].items():
        try:
            loaded.update(_verify_file(folder / name, name, expected, load))
        except OSError as e:  # e.g. a file of mode 000: named, never a traceback
            raise CheckpointError(
                f"{folder / name} cannot be read ({e.strerror or type(e).__name__}); make it readable by this "
                "user (chmod, chown), or use an earlier checkpoint"
            ) from None
    if manifest.get(SHARDED_KEY):
        # DCP's files verified: its index must also match them, or the checkpoint verifies and cannot load.
        from ddpkit.checkpoint.disk.sharded_reading import check_index

        try:
            check_index(folder, manifest["files"], (lambda path, data: load_file(path, data=data)) if load else None)
        except OSError as e:
            raise CheckpointError(
                f"checkpoint {folder}'s shards cannot be read ({e.strerror or type(e).__name__}); make them "
                "readable by this user (chmod, chown), or use an earlier checkpoint"
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
    digest = hashlib.sha256(data).hexdigest() if data is not None else file_sha256(path)
    if digest != expected["sha256"]:
        raise CheckpointError(f"{path} is damaged: its SHA-256 does not match the manifest; use an earlier checkpoint")
    return {name: load_file(path, data=data)} if data is not None else {}
