"""A checkpoint in object storage, read where a local one is: ``init_from=s3://...``, ``ddpkit export s3://...``.

Export and transfer read local folders. Given a URL, :func:`local_checkpoint` downloads the checkpoint it
names, or the newest complete one under it that verifies (a run's prefix, or its ``checkpoints`` prefix, as
``resume=auto`` takes it), into a temporary folder for the block, every file checked against the manifest's
size and SHA-256 as it arrives (:func:`~ddpkit.checkpoint.remote.transfer.fetch_checkpoint`). A newer
checkpoint that is incomplete or does not verify is named in a warning and skipped, as on disk.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

from ddpkit.checkpoint.disk.format import MANIFEST, CheckpointError
from ddpkit.checkpoint.disk.layout import BEST_PREFIX
from ddpkit.checkpoint.remote.store import is_remote, remote_folder
from ddpkit.checkpoint.remote.transfer import fetch_checkpoint, remote_checkpoints
from ddpkit.log import get_logger


@contextlib.contextmanager
def local_checkpoint(path: str | os.PathLike[str]) -> Iterator[tuple[Path, str]]:
    """``path`` itself when local; for a URL, a verified local copy of its checkpoint, removed after the block.

    Yields:
        The local folder, and the checkpoint's name for the user: ``path`` itself, or the URL of the
        checkpoint chosen under it.

    Raises:
        CheckpointError: the URL holds no complete checkpoint that verifies (each problem named).
        UserError: the URL's file system is not installed, or unknown.
    """
    if not is_remote(path):
        yield Path(path), os.fspath(path)
        return
    url = os.fspath(path).rstrip("/")
    with tempfile.TemporaryDirectory(prefix="ddpkit-fetch-") as tmp:
        folder = remote_folder(url)
        if folder.fs.exists(folder.join(MANIFEST)):
            yield fetch_checkpoint(url, Path(tmp)), url
        else:
            root = remote_root(url)
            fetched = _newest_fetched(root, url, Path(tmp))
            yield fetched, f"{root}/{fetched.name}"


def remote_root(url: str) -> str:
    """The checkpoints prefix of ``url``: itself when it holds checkpoints, else ``url/checkpoints`` if that does
    (a run's ``output_dir``), as :func:`~ddpkit.checkpoint.disk.format.resolve_checkpoint_dir` for a folder."""
    url = url.rstrip("/")
    if not remote_checkpoints(url) and not remote_checkpoints(url, prefix=BEST_PREFIX):
        if remote_checkpoints(url + "/checkpoints"):
            return url + "/checkpoints"
    return url


def _newest_fetched(root: str, url: str, tmp: Path) -> Path:
    """The newest complete checkpoint under ``root`` (of the user's ``url``) that verifies, fetched into ``tmp``."""
    problems = []
    for info in reversed(remote_checkpoints(root)):
        name = info.name
        if info.manifest is None:
            problems.append(f"{name} is incomplete (no manifest)")
            continue
        try:
            fetched = fetch_checkpoint(f"{root}/{name}", tmp)
        except CheckpointError as e:
            problems.append(str(e))
            continue
        for problem in problems:
            get_logger().warning(f"skipping a newer checkpoint than {name}: {problem}")
        return fetched
    detail = f" ({'; '.join(problems)})" if problems else ""
    raise CheckpointError(f"{url} holds no complete, verified checkpoint{detail}; pass a checkpoint's URL")
