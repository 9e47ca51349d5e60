"""Rank 0's writer for a remote checkpoints folder: stage on disk as always, upload in the background.

:class:`RemoteWriter` implements the Checkpointer's
:class:`~ddpkit.checkpoint.disk.writer.CheckpointWriter` over a local writer (a
:class:`~ddpkit.checkpoint.disk.writer.FolderWriter`, or the sharded one) that writes into the staging folder
with every promise of the disk format (atomic files, manifest last, best mark, ``keep``). Once a checkpoint
is complete there, it is uploaded on a background thread (:class:`~ddpkit.checkpoint.disk.async_save.BackgroundWriter`):

- at most one upload in flight: the next save, ``wait()`` (a preemption's) and ``close()`` wait for it;
- every file, then the manifest (:func:`~ddpkit.checkpoint.remote.transfer.upload_checkpoint`), then the
  ``best-*`` copy, then ``keep`` applied in the bucket (:func:`~ddpkit.checkpoint.remote.transfer.prune_remote`);
- a failed upload is tried ``UPLOAD_TRIES`` times with backoff, then ``on_write_error`` decides: a
  :class:`~ddpkit.checkpoint.disk.storage.StorageError` (exit status 74) at the next save, ``wait()`` or
  ``close()``, or a warning and training goes on (always the error for a preemption's checkpoint);
- facts added to a manifest later (metrics at ``epoch_end()``, ``finished`` at ``close()``) are uploaded as
  a new manifest object once the checkpoint itself is there.

It also holds the prefix's lease (:mod:`ddpkit.checkpoint.remote.lease`), given back once the last upload ended.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from ddpkit.checkpoint.disk.async_save import BackgroundWriter
from ddpkit.checkpoint.disk.format import BEST_PREFIX, MANIFEST, STEP_PREFIX, CheckpointError
from ddpkit.checkpoint.disk.storage import StorageError
from ddpkit.checkpoint.disk.writer import CheckpointWriter, WriteRequest
from ddpkit.checkpoint.remote.lease import RemoteLease
from ddpkit.checkpoint.remote.staging import pull_newest
from ddpkit.checkpoint.remote.store import RemoteFolder, is_remote, remote_folder, unreachable
from ddpkit.checkpoint.remote.transfer import (
    fetch_into,
    prune_best,
    prune_remote,
    remote_checkpoints,
    upload_checkpoint,
)
from ddpkit.log import get_logger

__all__ = ["BACKOFF_SECONDS", "UPLOAD_TRIES", "RemoteWriter"]

UPLOAD_TRIES = 4
"""Tries of one upload before ``on_write_error`` decides."""
BACKOFF_SECONDS = 1.0
"""The wait before the second try, doubled before each next one (1, 2, 4 s)."""


class RemoteWriter:
    """Stages checkpoints with a local writer and uploads them to ``folder``; see the module docstring.

    Args:
        folder: the remote checkpoints folder.
        staging: the local folder checkpoints are staged in.
        local: makes the writer of the staging folder, given the callback it calls once a checkpoint is complete.
        keep: complete checkpoints kept in the bucket.
        on_write_error: "stop" or "warn" once an upload failed every try.
        on_save: called with (staged folder, reason) once a checkpoint is uploaded (on the caller's thread).
    """

    def __init__(
        self,
        folder: RemoteFolder,
        staging: Path,
        local: Callable[[Callable[[Path, str], None]], CheckpointWriter],
        *,
        keep: int,
        on_write_error: str,
        on_save: Callable[[Path, str], None],
    ) -> None:
        self.folder, self.keep, self.on_write_error, self.on_save = folder, keep, on_write_error, on_save
        self.staging = staging
        self.local = local(self._staged)
        self.lease = RemoteLease(folder, fix="dir=... (checkpoint.dir=...)")
        self._uploads = BackgroundWriter()

    # -- the run's prefix ------------------------------------------------------------

    def claim(self, restarted: bool) -> None:
        """Take the prefix's lease (before the first write). Raises FolderInUseError: another run holds it."""
        self.lease.acquire(restarted)

    def check_fresh(self) -> None:
        """Refuse a fresh start (no resume) into a prefix that holds complete checkpoints; set aside what is staged.

        Raises:
            CheckpointError: it does (the message names the newest and the fix).
        """
        complete = [info for info in remote_checkpoints(self.folder) if info.complete]
        if complete:
            raise CheckpointError(
                f"{self.folder.url} already holds checkpoints (newest: {complete[-1].name}); continue that "
                "run with resume=auto, or start a new one under another prefix"
            )
        pull_newest(self.folder, self.staging)  # staged leftovers of an earlier run set aside

    def pull(self, choice: str) -> str:
        """Before a resume makes ``choice``: the uploads in flight done, the newest complete remote checkpoint
        staged; returns the choice with a checkpoint's URL (``resume="s3://.../step-000000120"``) replaced by its
        staged, verified copy."""
        self.wait()
        pull_newest(self.folder, self.staging)
        if not is_remote(choice):
            return choice
        parent, _, name = choice.rstrip("/").rpartition("/")
        return str(fetch_into(remote_folder(parent), name, self.staging / name))

    # -- CheckpointWriter --------------------------------------------------------------

    def write(self, request: WriteRequest) -> Path | None:
        """Wait for the upload in flight, then stage ``request`` (its upload starts once it is complete)."""
        self.wait()
        return self.local.write(request)

    def annotate(self, path: Path, updates: Mapping[str, Any], best: bool) -> None:
        """Add facts to the staged manifest, then upload it anew (after the checkpoint's own upload)."""
        self.local.annotate(path, updates, best)
        self.local.wait()  # the staged manifest rewritten (its write may be in the background)
        self._uploads.submit(lambda: self._try(lambda: self._upload_manifest(path), path.name, "annotated"))

    def wait(self) -> None:
        """Wait for the staging write and the upload in flight; raise a failed one's error."""
        self.local.wait()
        self._uploads.collect(wait=True)

    def close(self, failed: bool) -> None:
        """Finish the staging write and the upload in flight, then give the lease back (``failed``: raise nothing)."""
        try:
            self.local.close(failed)
            if failed:
                self._uploads.join()
            else:
                self._uploads.collect(wait=True)
        finally:
            self.lease.release()

    # -- uploading ------------------------------------------------------------------------

    def _staged(self, path: Path, reason: str) -> None:
        """The local writer's callback: ``path`` is complete in the staging folder; upload it."""
        self._uploads.submit(
            lambda: self._try(lambda: self._upload(path), path.name, reason),
            on_done=lambda uploaded: self.on_save(path, reason) if uploaded else None,
        )

    def _upload(self, path: Path) -> None:
        url = upload_checkpoint(path, self.folder)
        best = path.with_name(path.name.replace(STEP_PREFIX, BEST_PREFIX, 1))
        if best.is_dir():  # this checkpoint is the best so far (its best-* twin was just made)
            upload_checkpoint(best, self.folder)
            prune_best(self.folder, best.name)
        prune_remote(self.folder, self.keep, protect=path.name)
        get_logger().info(f"checkpoint {path.name} uploaded to {url}")

    def _upload_manifest(self, path: Path) -> None:
        target = self.folder.join(path.name, MANIFEST)
        if not self.folder.fs.exists(target):  # its upload failed (and said so): no manifest without the files
            return
        self.folder.fs.put_file(str(path / MANIFEST), target)
        best = path.with_name(path.name.replace(STEP_PREFIX, BEST_PREFIX, 1))
        if best.is_dir():
            upload_checkpoint(best, self.folder)
            prune_best(self.folder, best.name)

    def _try(self, upload: Callable[[], None], name: str, reason: str) -> bool:
        """Run ``upload`` up to UPLOAD_TRIES times; then warn (False) or raise StorageError, per on_write_error."""
        delay = BACKOFF_SECONDS
        for attempt in range(1, UPLOAD_TRIES + 1):
            try:
                upload()
                return True
            except Exception as e:  # noqa: BLE001 - the store's library raises its own kinds; all are retried
                error = e
            if attempt < UPLOAD_TRIES:
                time.sleep(delay)
                delay *= 2
        message = f"checkpoint {name} not uploaded in {UPLOAD_TRIES} tries (staged in {self.staging}): " + unreachable(
            self.folder, error
        )
        if self.on_write_error == "warn" and reason != "preempted":
            get_logger().warning(f"{message} (training goes on: on_write_error=warn)")
            return False
        raise StorageError(message) from None
