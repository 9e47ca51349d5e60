"""Rank 0's writer for sharded checkpoints: completes the folder every rank wrote its shards into.

The :class:`~ddpkit.checkpoint.writer.FolderWriter`'s promises (atomic,
verified, best mark, pruning, a failed write as one line), for a folder
whose model and optimizer files the ranks wrote already
(:meth:`ddpkit.checkpoint.sharded.ShardedState.save`): rank 0 adds the other
objects' files and the manifest, with every file's size and SHA-256, last,
then renames the folder into place (:func:`ddpkit.checkpoint.format.finish_checkpoint`).
Writes are synchronous: the shards are written by every rank before the
Checkpointer hands over the request.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from ddpkit.checkpoint.format import finish_checkpoint, mark_best, prune
from ddpkit.checkpoint.writer import FolderWriter, WriteRequest
from ddpkit.log import get_logger

__all__ = ["ShardedWriter"]


class ShardedWriter(FolderWriter):
    """A :class:`~ddpkit.checkpoint.writer.FolderWriter` that completes the staging folder of the ranks' shards.

    Args:
        staged: the staging folder the ranks wrote into and the sizes and SHA-256 of their files
            (:attr:`ddpkit.checkpoint.sharded.ShardedState.staged`), asked at each write.
        **options: the FolderWriter's, less ``background`` (sharded writes are synchronous).
    """

    def __init__(self, root: Path, *, staged: Callable[[], tuple[Path, dict[str, Any]]], **options: Any) -> None:
        super().__init__(root, background=False, **options)
        self.staged = staged

    def _write_files(self, request: WriteRequest) -> Path | None:
        folder, written = self.staged()
        try:
            path = finish_checkpoint(
                self.root, folder, request.name, request.objects, request.texts, request.meta, written, self.mode
            )
        except OSError as e:
            self._write_failed(request, e)
            return None
        if request.best:
            mark_best(self.root, path, self.mode)
        prune(self.root, self.keep, protect=path)
        get_logger().info(f"checkpoint {path} ({request.why}; sharded: every rank wrote its shards)")
        return path
