"""What goes to disk and how: the Checkpointer's writer, run on rank 0.

The Checkpointer decides when (:mod:`ddpkit.checkpoint.manager.schedule`) and
gathers what (every object's ``state_dict()``, every rank's RNG); a writer
puts it on disk:

- the atomic, verified folder of :mod:`ddpkit.checkpoint.disk.format` (each file
  through a temporary name, fsync and rename; the manifest with checksums
  last);
- synchronously, or in the background (``async_save``): the state is copied
  first (CUDA tensors into pinned CPU memory whose buffers are reused by the
  next save), at most one write is in flight, and a failed write is raised at
  the next save, ``wait()`` or ``close()``;
- then the best mark (``best-*``, hard links) and pruning to ``keep``;
- a write that fails for lack of room, permissions or a vanished folder is
  one line (:mod:`ddpkit.checkpoint.disk.storage`): a warning and training goes on
  (``on_write_error="warn"``), or :class:`~ddpkit.checkpoint.disk.storage.StorageError`.

:class:`CheckpointWriter` is the interface the Checkpointer uses; a writer
of another kind (each rank writing its shards, a remote store) implements
the same four methods.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol

from ddpkit.checkpoint.disk.async_save import BackgroundWriter, copy_state
from ddpkit.checkpoint.disk.finite import nonfinite_marker, nonfinite_tensors
from ddpkit.checkpoint.disk.format import (
    MANIFEST,
    checkpoint_digest,
    mark_best,
    prune,
    read_manifest,
    rewrite_manifest,
    write_checkpoint,
)
from ddpkit.checkpoint.disk.storage import StorageError, explain_write_error
from ddpkit.log import get_logger

__all__ = ["CheckpointWriter", "FolderWriter", "WriteRequest"]


class WriteRequest:
    """One checkpoint to write: its folder name, files and manifest facts, and what to say of it.

    Args:
        name: the folder name (``step-000000120``).
        objects: file name -> state for ``torch.save``.
        texts: file name -> text.
        meta: the manifest's facts (step, epoch, metrics...).
        best: mark it ``best-*``.
        reason: why it is written (the manifest's ``reason``; a preemption's write always stops on failure).
        why: the log line's parenthesis.
    """

    def __init__(
        self,
        name: str,
        objects: dict[str, Any],
        texts: dict[str, str],
        meta: dict[str, Any],
        *,
        best: bool,
        reason: str,
        why: str,
    ):
        self.name, self.objects, self.texts, self.meta = name, objects, texts, meta
        self.best, self.reason, self.why = best, reason, why


class CheckpointWriter(Protocol):
    """How the Checkpointer puts a checkpoint on disk (rank 0)."""

    def write(self, request: WriteRequest) -> Path | None:
        """Write ``request`` (or start writing it); return its folder, None if it failed and training goes on."""
        ...

    def annotate(self, path: Path, updates: Mapping[str, Any], best: bool) -> None:
        """Add facts to the manifest of the checkpoint written last (after its write, when in flight)."""
        ...

    def wait(self) -> None:
        """Wait for the write in flight; raise its error."""
        ...

    def close(self, failed: bool) -> None:
        """Finish: wait for the write in flight (``failed``: an exception is unwinding; raise nothing new)."""
        ...


class FolderWriter:
    """Writes checkpoint folders under ``root``, synchronously or in the background; see the module docstring.

    Args:
        root: the checkpoints folder.
        mode: file permission bits.
        keep: complete checkpoints kept.
        async_save: write on a background thread.
        on_write_error: "stop" (raise StorageError) or "warn" (log, go on) when a write fails.
        needed_bytes: the expected size of a checkpoint, for a failed write's message.
        on_save: called with (path, reason) once a checkpoint is complete (on this thread).
        shown: how its lines name a checkpoint (a staged one: the URL it is uploaded to).
    """

    def __init__(
        self,
        root: Path,
        *,
        mode: int,
        keep: int,
        async_save: bool,
        on_write_error: str,
        needed_bytes: Callable[[], int],
        on_save: Callable[[Path, str], None],
        shown: Callable[[Path], str] = str,
    ):
        self.root, self.mode, self.keep = root, mode, keep
        self.on_write_error, self.needed_bytes, self.on_save = on_write_error, needed_bytes, on_save
        self.shown = shown
        self._background = BackgroundWriter() if async_save else None
        self._buffers: list[Any] = []  # the copy's storages, reused by the next save once its write is done

    def write(self, request: WriteRequest) -> Path | None:
        """Write the checkpoint now, or copy its state and write it in the background; see the module docstring."""
        self.wait()  # at most one save in flight
        background = self._background is not None
        # Off the training path when in the background: copies the loop may change at once; either way CUDA
        # tensors are on the CPU, so that both modes write the same bytes.
        objects = copy_state(
            request.objects, copy_cpu=background, pin_memory=True, buffers=self._buffers if background else None
        )
        request.objects = objects
        if self._background is None:
            path = self._write_files(request)
            self._saved(path, request.reason)
            return path
        self._background.submit(
            lambda: self._write_files(request), on_done=lambda path: self._saved(path, request.reason)
        )
        return self.root / request.name

    def _write_files(self, request: WriteRequest) -> Path | None:
        """The checkpoint folder, the best mark, pruning (on the writer's thread when in the background)."""
        marker = self._mark_nonfinite(request, nonfinite_tensors(request.objects))
        try:
            path = write_checkpoint(self.root, request.name, request.objects, request.texts, request.meta, self.mode)
        except OSError as e:  # a warning (on_write_error="warn"), or it raises
            self._write_failed(request, explain_write_error(self.root, request.name, e, self.needed_bytes()))
            return None
        self._written(path, request, marker)
        return path

    @staticmethod
    def _mark_nonfinite(request: WriteRequest, nonfinite: list[str]) -> dict[str, Any]:
        """Mark a state holding NaN or infinity (a diverged run) in ``request``'s manifest facts; return the marker.

        Such a checkpoint never counts toward ``keep``, never becomes the best, and ``resume="auto"`` sets it
        aside for the newest finite one.
        """
        marker = nonfinite_marker(nonfinite)
        if marker:
            request.meta = {**request.meta, **marker}
            request.best = False
        return marker

    def _written(self, path: Path, request: WriteRequest, marker: Mapping[str, Any], how: str = "") -> None:
        """After ``path`` is complete: the best mark, pruning, and one line (``how``: added to its parenthesis)."""
        if request.best:
            mark_best(self.root, path, self.mode)
        prune(self.root, self.keep, protect=path)
        if marker:
            get_logger().warning(
                f"checkpoint {self.shown(path)} ({request.reason}) holds NaN or infinity ({', '.join(marker['nonfinite_tensors'])}): "
                "it is kept apart, never counted toward keep, and resume=auto continues from the newest finite one; "
                "lower the learning rate or check the data"
            )
        else:
            # The digest, kept elsewhere (a log, a tracker), later shows the checkpoint unchanged (ddpkit checkpoints).
            digest = checkpoint_digest(read_manifest(path))
            get_logger().info(f"checkpoint {self.shown(path)} ({request.why}{how}), digest {digest}")

    def _saved(self, path: Path | None, reason: str) -> None:
        if path is not None:
            self.on_save(path, reason)

    def _write_failed(self, request: WriteRequest, message: str) -> None:
        """After a failed write (the incomplete folder is gone; ``message`` says why in one line): warn and go
        on, or raise StorageError (always for a preemption's checkpoint)."""
        if self.on_write_error == "warn" and request.reason != "preempted":
            get_logger().warning(f"{message} (training goes on: on_write_error=warn)")
            return
        raise StorageError(message) from None

    def annotate(self, path: Path, updates: Mapping[str, Any], best: bool) -> None:
        """Rewrite the manifest of ``path`` with ``updates`` (and mark it best), after its write in flight."""
        root, mode = self.root, self.mode

        def annotate() -> None:
            if not (path / MANIFEST).exists():  # its write failed (and said so), or the folder is gone
                return
            rewrite_manifest(path, updates, mode)
            if best:
                mark_best(root, path, mode)

        if self._background is None:
            annotate()
            return
        self._background.collect(wait=False)
        self._background.submit(annotate)

    def wait(self) -> None:
        """Hand back finished background writes (``on_save``), waiting for the one in flight; raise its error."""
        if self._background is not None:
            self._background.collect(wait=True)

    def close(self, failed: bool) -> None:
        """Complete the write in flight; with ``failed`` (an exception unwinds) raise nothing, hand nothing back."""
        try:
            if failed:
                if self._background is not None:
                    self._background.join()
            else:
                self.wait()
        finally:
            self._buffers = []  # the copy's memory goes back
