"""The local staging folder of a remote checkpoints folder, and what it holds before a resume chooses.

Checkpoints for a URL are written into a local folder first, exactly as on disk, and uploaded from there
(:mod:`ddpkit.checkpoint.remote.writer`). The folder is ``checkpoint.cache=`` when given, else
``$DDPKIT_CACHE/checkpoints/<name>-<hash of the URL>``, else the same under ``~/.cache/ddpkit``: one per
URL, so that two prefixes never share one.

Every node stages its own copy: rank 0 the one it chooses, the other nodes' ranks the same one once rank 0
has chosen (:func:`stage_checkpoint`), unless the cache folder is shared. Before a resume chooses (:func:`pull_newest`), the staging folder is made to hold what the bucket holds: the
bucket is the truth. A staged checkpoint the bucket does not hold complete (its upload was cut off) is set
aside as ``.not-uploaded``, never deleted (it may be the only copy); the newest complete checkpoint in the
bucket is downloaded and verified unless the same one is staged already; one that does not verify is
skipped, in one line, for the one before it.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Mapping
from pathlib import Path

from filelock import FileLock

from ddpkit.checkpoint.disk.format import MANIFEST, CheckpointError, list_checkpoints, set_aside
from ddpkit.checkpoint.remote.store import RemoteFolder, default_cache, folded_url, is_remote, remote_folder
from ddpkit.checkpoint.remote.transfer import fetch_into, remote_checkpoints
from ddpkit.errors import UserError
from ddpkit.log import get_logger

__all__ = [
    "NOT_UPLOADED_SUFFIX",
    "checkpoint_root",
    "pull_newest",
    "shown_as_url",
    "stage_checkpoint",
    "staging_folder",
]

NOT_UPLOADED_SUFFIX = ".not-uploaded"
"""The suffix of a staged checkpoint set aside because the bucket does not hold it complete."""


def staging_folder(url: str, cache: str, environ: Mapping[str, str]) -> Path:
    """The local folder where the checkpoints of ``url`` are staged: ``cache`` when given, else one of its own
    under :func:`default_cache` named after the URL's last part and a hash of the whole."""
    if cache:
        return Path(cache).expanduser()
    name = url.rstrip("/").rsplit("/", 1)[-1] or "run"
    return default_cache(environ) / f"{name}-{hashlib.sha256(url.encode()).hexdigest()[:12]}"


def checkpoint_root(
    dir: str | os.PathLike[str], cache: str, environ: Mapping[str, str]
) -> tuple[Path, RemoteFolder | None]:
    """Where a Checkpointer given ``dir`` writes: the folder itself, or for a URL its staging folder and the
    remote folder (:func:`staging_folder`; ``cache``: ``checkpoint.cache=``).

    Raises:
        UserError: ``dir`` is a URL that ``pathlib.Path`` folded (``s3:/bucket/run``); the line says so.
    """
    if not is_remote(dir):
        if url := folded_url(dir):  # a local folder named "s3:" is never what was meant
            raise UserError(
                f"checkpoint folder {os.fspath(dir)} is the URL {url} with its // folded into / (pathlib.Path "
                "does that); pass the URL as a string"
            )
        return Path(dir), None
    remote = remote_folder(dir)
    return staging_folder(remote.url, cache, environ), remote


def shown_as_url(folder: RemoteFolder | None, staging: Path) -> Callable[[str | os.PathLike[str]], str]:
    """How the lines a user reads name a checkpoint or the checkpoints folder: for a remote ``folder``, a path in
    its ``staging`` folder as the URL it stands for (``s3://bucket/run/step-000000007``), since that is where the
    checkpoint lives and where the next run finds it; any other path as it is."""

    def shown(path: str | os.PathLike[str]) -> str:
        if folder is None or not Path(path).is_relative_to(staging):
            return os.fspath(path)
        return folder.url_of(*Path(path).relative_to(staging).parts)

    return shown


def pull_newest(folder: RemoteFolder, staging: Path) -> Path | None:
    """Make ``staging`` hold the newest complete checkpoint of ``folder`` that verifies; see the module docstring.

    Returns:
        The staged checkpoint, or None when the bucket holds none that verifies.
    """
    log = get_logger()
    remote = [info for info in remote_checkpoints(folder) if info.manifest is not None]
    names = {info.name for info in remote}
    for local in list_checkpoints(staging):
        if local.path.name not in names:
            target = set_aside(local.path, NOT_UPLOADED_SUFFIX)
            log.warning(f"set {local.path} aside as {target.name}: {folder.url} does not hold it complete")
    for info in reversed(remote):
        name = info.name
        try:
            return fetch_into(folder, name, staging / name)
        except CheckpointError as e:
            log.warning(f"resume=auto: skipping checkpoint {folder.url_of(name)}: {e}")
            if (staging / name / MANIFEST).exists():  # a staged copy of another write of that step: not this one
                set_aside(staging / name, NOT_UPLOADED_SUFFIX)
    return None


def stage_checkpoint(folder: RemoteFolder | None, staging: Path, chosen: Path) -> Path:
    """On a rank other than 0: the checkpoint rank 0 chose (``chosen``, in rank 0's staging folder), staged in
    this rank's ``staging`` folder; ``chosen`` itself for a local folder.

    A node whose staging folder is not rank 0's (each node's own cache) downloads it, verified; the ranks
    of one node take turns (a file lock), so one of them downloads and the others find it there. (A sharded
    run's ranks write their shards into their own node's staging folder: across nodes, it needs
    ``checkpoint.cache=`` on a folder every node sees.)
    """
    path = staging / chosen.name
    if folder is None or path == chosen:  # rank 0's node: rank 0 has just staged and verified it
        return chosen
    staging.mkdir(parents=True, exist_ok=True, mode=0o700)
    with FileLock(str(staging / f".{path.name}.fetch.lock")):
        return fetch_into(folder, path.name, path)  # a copy staged earlier is used if its manifest is the same
