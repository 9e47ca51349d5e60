"""Checkpoint folders to and from object storage: upload with the manifest last, verified download, listing,
and deletion with the manifest first.

The order is the format's promise carried over to a store without renames: a checkpoint is complete once
its manifest object exists, so the manifest is the last object written and the first deleted.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ddpkit.checkpoint.disk.format import MANIFEST, CheckpointError, verify_checkpoint
from ddpkit.checkpoint.disk.layout import BEST_PREFIX, NAME_PATTERN, STEP_PREFIX
from ddpkit.checkpoint.disk.reading import ManifestFacts
from ddpkit.checkpoint.remote.store import RemoteFolder, default_cache, remote_folder

__all__ = [
    "RemoteCheckpoint",
    "delete_checkpoint",
    "fetch_into",
    "fetch_checkpoint",
    "prune_best",
    "prune_remote",
    "remote_checkpoints",
    "upload_checkpoint",
]

_CHUNK = 1 << 20


def _folder(url: str | os.PathLike[str] | RemoteFolder) -> RemoteFolder:
    return url if isinstance(url, RemoteFolder) else remote_folder(url)


@dataclass(frozen=True)
class RemoteCheckpoint(ManifestFacts):
    """A checkpoint in object storage as listed (complete or not): a local ``CheckpointInfo``'s facts, by URL."""

    url: str
    """The checkpoint's URL (``s3://bucket/run/step-000000120``)."""
    global_step: int
    """The step in its name."""
    manifest: dict[str, Any] | None = field(default=None, compare=False)
    """The parsed manifest, or None when it has none (an upload in progress or cut off)."""
    problem: str = ""
    """Why the manifest could not be parsed, if it exists but is damaged."""

    @property
    def name(self) -> str:
        """The checkpoint's name (``step-000000120``)."""
        return self.url.rsplit("/", 1)[-1]

    @property
    def size(self) -> int:
        """Bytes of its files, as its manifest lists them (0 without one)."""
        files = (self.manifest or {}).get("files", {})
        return sum(int(facts.get("bytes", 0)) for facts in files.values())


def remote_checkpoints(url: str | os.PathLike[str] | RemoteFolder, prefix: str = STEP_PREFIX) -> list[RemoteCheckpoint]:
    """The checkpoints under ``url`` named ``<prefix><step>``, oldest first, as ``list_checkpoints`` gives a local
    folder's; one without a manifest is listed too (incomplete)."""
    folder = _folder(url)
    folder.forget_listings()
    if not folder.fs.exists(folder.path):
        return []
    found = []
    for entry in folder.fs.ls(folder.path, detail=False):
        name = entry.rstrip("/").rsplit("/", 1)[-1]
        match = NAME_PATTERN.match(name)
        if not match or not name.startswith(prefix):
            continue
        manifest, problem = None, ""
        try:
            manifest = _parse_manifest(folder.fs.cat_file(folder.join(name, MANIFEST)), folder.url_of(name))
        except FileNotFoundError:
            pass
        except CheckpointError as e:
            problem = str(e)
        found.append(RemoteCheckpoint(folder.url_of(name), int(match.group(2)), manifest, problem))
    return sorted(found, key=lambda info: info.global_step)


def _parse_manifest(data: bytes, where: str) -> dict[str, Any]:
    try:
        manifest = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{where}/{MANIFEST} is damaged ({e}); use an earlier checkpoint") from None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        raise CheckpointError(f"{where}/{MANIFEST} is not a checkpoint manifest; use an earlier checkpoint")
    return manifest


def fetch_checkpoint(url: str | os.PathLike[str], cache_dir: Path | None = None, *, into: Path | None = None) -> Path:
    """A verified local copy of the checkpoint at ``url`` (``s3://bucket/run/step-000000120``).

    The manifest is read first; each file it lists is downloaded and checked against its size and SHA-256
    as it arrives; only then is the copy renamed into place (a cut-off download leaves no folder that looks
    complete). A local copy already there with the same manifest is verified and used as it is (downloaded
    again when it does not verify).

    Args:
        url: the checkpoint's URL.
        cache_dir: the folder the copy goes into (its own name kept); default: ``$DDPKIT_CACHE`` or
            ``~/.cache/ddpkit``, under ``checkpoints/``.
        into: the exact folder of the copy (instead of ``cache_dir/<name>``).

    Raises:
        CheckpointError: no manifest (not a complete checkpoint), a file missing, truncated or changed;
            the message names the object and the fix.
    """
    text = os.fspath(url).rstrip("/")
    parent, _, name = text.rpartition("/")
    folder = remote_folder(parent)
    target = into if into is not None else (cache_dir or default_cache(os.environ)) / name
    return fetch_into(folder, name, target)


def fetch_into(folder: RemoteFolder, name: str, target: Path) -> Path:
    """:func:`fetch_checkpoint` of the checkpoint ``name`` under ``folder`` into the folder ``target``."""
    fs = folder.fs
    try:
        manifest_bytes = fs.cat_file(folder.join(name, MANIFEST))
    except FileNotFoundError:
        raise CheckpointError(
            f"{folder.url_of(name)} is not a complete checkpoint: it has no {MANIFEST} (its upload never "
            "finished, or is still in progress); use an earlier checkpoint"
        ) from None
    manifest = _parse_manifest(manifest_bytes, folder.url_of(name))
    if (target / MANIFEST).is_file() and (target / MANIFEST).read_bytes() == manifest_bytes:
        try:
            verify_checkpoint(target, load=False)
            return target
        except CheckpointError:
            pass  # the local copy was damaged since: downloaded again below, replacing it
    target.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    staging = target.with_name(f".{target.name}.fetch-{uuid.uuid4().hex[:8]}")
    staging.mkdir(mode=0o700)
    try:
        for file_name, expected in manifest["files"].items():
            if Path(file_name).name != file_name or file_name in ("", ".", ".."):
                raise CheckpointError(
                    f"{folder.url_of(name, MANIFEST)} is damaged: it lists {file_name!r}, outside the checkpoint"
                )
            _download(fs, folder.join(name, file_name), staging / file_name, expected, folder.url_of(name, file_name))
        (staging / MANIFEST).write_bytes(manifest_bytes)
        os.chmod(staging / MANIFEST, 0o600)
        if target.exists():
            shutil.rmtree(target)
        os.rename(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _download(fs: Any, source: str, target: Path, expected: dict[str, Any], where: str) -> None:
    """One file, checked against its manifest entry as it arrives."""
    digest, size = hashlib.sha256(), 0
    try:
        with fs.open(source, "rb") as remote, open(target, "xb") as local:
            os.fchmod(local.fileno(), 0o600)
            while chunk := remote.read(_CHUNK):
                digest.update(chunk)
                size += len(chunk)
                local.write(chunk)
    except FileNotFoundError:
        raise CheckpointError(f"{where} is missing; the checkpoint is incomplete; use an earlier checkpoint") from None
    if size != expected.get("bytes"):
        raise CheckpointError(
            f"{where} is truncated or damaged: {size} bytes in the store, {expected.get('bytes')} in the "
            "manifest; use an earlier checkpoint"
        )
    if digest.hexdigest() != expected.get("sha256"):
        raise CheckpointError(f"{where} is damaged: its SHA-256 does not match the manifest; use an earlier checkpoint")


def upload_checkpoint(local: Path, url: str | os.PathLike[str] | RemoteFolder, name: str | None = None) -> str:
    """Upload the complete local checkpoint ``local`` to ``url/<name>``: every file, then the manifest last.

    A checkpoint of that name already there (a save that replaces this step's) loses its manifest first,
    so that no reader takes the old manifest with the new files as complete.

    Args:
        local: a complete checkpoint folder (with its manifest).
        url: the remote checkpoints folder (``s3://bucket/run``).
        name: the checkpoint's name there; default: ``local``'s.

    Returns:
        The checkpoint's URL.

    Raises:
        CheckpointError: ``local`` has no manifest.
        OSError: the store refused or could not be reached (fsspec's errors).
    """
    folder = _folder(url)
    name = name or local.name
    if not (local / MANIFEST).is_file():
        raise CheckpointError(f"{local} is not a complete checkpoint: it has no {MANIFEST}; nothing uploaded")
    listed = _parse_manifest((local / MANIFEST).read_bytes(), str(local))["files"]
    fs = folder.fs
    manifest = folder.join(name, MANIFEST)
    if fs.exists(manifest):
        fs.rm_file(manifest)
    for file_name in sorted(listed):
        fs.put_file(str(local / file_name), folder.join(name, file_name))
    fs.put_file(str(local / MANIFEST), manifest)
    return folder.url_of(name)


def delete_checkpoint(url: str | os.PathLike[str] | RemoteFolder, name: str) -> None:
    """Delete the checkpoint ``name`` under ``url``: its manifest first (it stops being complete), then the rest."""
    folder = _folder(url)
    fs = folder.fs
    try:
        fs.rm_file(folder.join(name, MANIFEST))
    except FileNotFoundError:
        pass
    try:
        fs.rm(folder.join(name), recursive=True)
    except FileNotFoundError:
        pass


def prune_remote(folder: RemoteFolder, keep: int, protect: str) -> list[str]:
    """Delete all but the newest ``keep`` complete, finite checkpoints under ``folder``, as :func:`prune` does on
    disk; never ``protect`` (the one just uploaded) nor one without a manifest (an upload in progress).
    Older ``best-*`` ones go too, the one of ``protect``'s best mark excepted. Returns the deleted names."""
    infos = remote_checkpoints(folder)
    counted = [i for i in infos if i.manifest is not None and i.finite]
    kept = {i.name for i in counted[-keep:]} | {protect}
    deleted = [i.name for i in counted if i.name not in kept]
    for name in deleted:
        delete_checkpoint(folder, name)
    return deleted


def prune_best(folder: RemoteFolder, newest: str) -> None:
    """Delete every ``best-*`` checkpoint under ``folder`` but ``newest`` (manifest first)."""
    for info in remote_checkpoints(folder, prefix=BEST_PREFIX):
        if info.name != newest:
            delete_checkpoint(folder, info.name)
