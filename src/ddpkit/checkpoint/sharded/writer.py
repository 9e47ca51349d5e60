"""Rank 0's writer for sharded checkpoints: completes the folder every rank wrote its shards into.

The :class:`~ddpkit.checkpoint.disk.writer.FolderWriter`'s promises (atomic,
verified, best mark, pruning, a failed write as one line, in the background
or not), for a folder whose model and optimizer files the ranks write
(:meth:`ddpkit.checkpoint.sharded.state.ShardedState.save`): once every rank wrote,
rank 0 adds the other objects' files and the manifest, with every file's size
and SHA-256, last, then renames the folder into place
(:func:`ddpkit.checkpoint.disk.format.finish_checkpoint`). A rank that could not
write its shards fails the write here, as a write of rank 0's own would, and
a rank that found NaN or infinity in its shards has the checkpoint marked
non-finite, as :class:`~ddpkit.checkpoint.disk.writer.FolderWriter` marks its own.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from ddpkit.checkpoint.disk.finite import nonfinite_tensors
from ddpkit.checkpoint.disk.format import finish_checkpoint
from ddpkit.checkpoint.disk.storage import StorageError, explain_write_error
from ddpkit.checkpoint.disk.writer import FolderWriter, WriteRequest
from ddpkit.checkpoint.sharded.state import Staged

__all__ = ["ShardedWriter"]


class ShardedWriter(FolderWriter):
    """A :class:`~ddpkit.checkpoint.disk.writer.FolderWriter` that completes the staging folder of the ranks' shards.

    Args:
        staged: waits until every rank wrote its shards of the newest save and returns its staging folder
            and files (:meth:`ddpkit.checkpoint.sharded.state.ShardedState.staged`); raises StorageError when a
            rank could not write.
        **options: the FolderWriter's.
    """

    def __init__(self, root: Path, *, staged: Callable[[], Staged], **options: Any) -> None:
        super().__init__(root, **options)
        self.staged = staged

    def _write_files(self, request: WriteRequest) -> Path | None:
        try:
            staged = self.staged()
        except StorageError as e:  # a rank's shards (the staging folder is gone)
            self._write_failed(request, str(e))
            return None
        marker = self._mark_nonfinite(request, staged.nonfinite + nonfinite_tensors(request.objects))
        try:
            path = finish_checkpoint(
                self.root,
                staged.folder,
                request.name,
                request.objects,
                request.texts,
                request.meta,
                staged.files,
                self.mode,
            )
        except OSError as e:
            self._write_failed(request, explain_write_error(self.root, request.name, e, self.needed_bytes()))
            return None
        self._written(path, request, marker, "; sharded: every rank wrote its shards")
        return path
