"""Checkpoints: crash-safe format, resume selection, the Checkpointer, preemption, export and transfer.

This module is the package's face: code outside ``ddpkit.checkpoint`` imports from here only, never from
a submodule (an import-linter contract in pyproject.toml holds that). The names come in two kinds:

- for users, also exported by ``ddpkit`` itself: :class:`Checkpointer`, :class:`ResumePoint`,
  :class:`CheckpointOptions`, :class:`CheckpointError`, :class:`CheckpointInfo`, :func:`list_checkpoints`,
  :class:`Preempted`, :class:`FolderLock`, :class:`FolderInUseError`, :func:`seed_everything`,
  :func:`export_checkpoint`, :func:`apply_transfer`, :class:`TransferReport`;
- for ddpkit's own commands and trainer (``ddpkit train``, ``ddpkit checkpoints``, the benchmarks), not a
  promise to users: the rest of ``__all__`` (reading a manifest, choosing a checkpoint to resume, checkpoints
  in object storage (:mod:`ddpkit.checkpoint.remote`), the non-finite checkpoints, the room on disk, the option values the command line checks).

The names are imported on first use, as ``ddpkit``'s are: ``ddpkit.train.config`` reads the options from here, and
``ddpkit --help`` must not wait for torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_PUBLIC = {
    # for users (ddpkit's own __all__ lists them too)
    "Checkpointer": "ddpkit.checkpoint.manager.checkpointer",
    "ResumePoint": "ddpkit.checkpoint.manager.checkpointer",
    "CheckpointOptions": "ddpkit.checkpoint.options",
    "CheckpointError": "ddpkit.checkpoint.disk.format",
    "CheckpointInfo": "ddpkit.checkpoint.disk.format",
    "list_checkpoints": "ddpkit.checkpoint.disk.format",
    "Preempted": "ddpkit.checkpoint.manager.preemption",
    "FolderLock": "ddpkit.checkpoint.disk.folder_lock",
    "FolderInUseError": "ddpkit.checkpoint.disk.folder_lock",
    "seed_everything": "ddpkit.checkpoint.rng",
    "export_checkpoint": "ddpkit.checkpoint.publishing.export",
    "apply_transfer": "ddpkit.checkpoint.publishing.transfer",
    "TransferReport": "ddpkit.checkpoint.publishing.transfer",
    # for ddpkit's commands and trainer: the options' values the command line checks
    "RESUME_MODES": "ddpkit.checkpoint.options",
    "resume_choice": "ddpkit.checkpoint.options",
    # reading a folder of checkpoints (``ddpkit checkpoints``, the benchmarks)
    "MANIFEST": "ddpkit.checkpoint.disk.format",
    "BEST_PREFIX": "ddpkit.checkpoint.disk.format",
    "read_manifest": "ddpkit.checkpoint.disk.format",
    "verify_checkpoint": "ddpkit.checkpoint.disk.format",
    "checkpoint_digest": "ddpkit.checkpoint.disk.format",
    "has_manifest": "ddpkit.checkpoint.disk.format",
    "resolve_checkpoint_dir": "ddpkit.checkpoint.disk.format",
    "set_aside": "ddpkit.checkpoint.disk.format",
    # which checkpoint a run resumes from (the trainer's checks before it starts)
    "candidates": "ddpkit.checkpoint.manager.select",
    "check_resume": "ddpkit.checkpoint.manager.select",
    "restart_count": "ddpkit.checkpoint.manager.select",
    "stored_checkpoints": "ddpkit.checkpoint.manager.select",
    # checkpoints of a diverged run (the trainer's rollback)
    "NONFINITE_SUFFIX": "ddpkit.checkpoint.disk.finite",
    "last_finite_checkpoint": "ddpkit.checkpoint.disk.finite",
    "nonfinite_tensors": "ddpkit.checkpoint.disk.finite",
    # checkpoints in object storage (ddpkit train's output_dir=s3://..., ddpkit checkpoints and export of a URL)
    "is_remote": "ddpkit.checkpoint.remote.store",
    "missing_library": "ddpkit.checkpoint.remote.store",
    "remote_checkpoints": "ddpkit.checkpoint.remote.transfer",
    "fetch_checkpoint": "ddpkit.checkpoint.remote.transfer",
    "upload_checkpoint": "ddpkit.checkpoint.remote.transfer",
    "local_checkpoint": "ddpkit.checkpoint.publishing.remote_source",
    "remote_root": "ddpkit.checkpoint.publishing.remote_source",
    # the room on disk (the trainer's metrics file)
    "format_bytes": "ddpkit.checkpoint.disk.storage",
    "free_bytes": "ddpkit.checkpoint.disk.storage",
}
"""Each name of the face, and the submodule that holds it."""

__all__ = list(_PUBLIC)

if TYPE_CHECKING:
    # What editors and type checkers read (the lazy loading below is invisible to them); ``X as X``
    # re-exports each name explicitly (mypy's strict mode, ruff).
    from ddpkit.checkpoint.disk.finite import (
        NONFINITE_SUFFIX as NONFINITE_SUFFIX,
        last_finite_checkpoint as last_finite_checkpoint,
        nonfinite_tensors as nonfinite_tensors,
    )
    from ddpkit.checkpoint.disk.folder_lock import FolderInUseError as FolderInUseError, FolderLock as FolderLock
    from ddpkit.checkpoint.disk.format import (
        BEST_PREFIX as BEST_PREFIX,
        MANIFEST as MANIFEST,
        CheckpointError as CheckpointError,
        CheckpointInfo as CheckpointInfo,
        checkpoint_digest as checkpoint_digest,
        has_manifest as has_manifest,
        list_checkpoints as list_checkpoints,
        read_manifest as read_manifest,
        resolve_checkpoint_dir as resolve_checkpoint_dir,
        set_aside as set_aside,
        verify_checkpoint as verify_checkpoint,
    )
    from ddpkit.checkpoint.disk.storage import format_bytes as format_bytes, free_bytes as free_bytes
    from ddpkit.checkpoint.manager.checkpointer import Checkpointer as Checkpointer, ResumePoint as ResumePoint
    from ddpkit.checkpoint.manager.preemption import Preempted as Preempted
    from ddpkit.checkpoint.manager.select import (
        candidates as candidates,
        check_resume as check_resume,
        restart_count as restart_count,
        stored_checkpoints as stored_checkpoints,
    )
    from ddpkit.checkpoint.options import (
        RESUME_MODES as RESUME_MODES,
        CheckpointOptions as CheckpointOptions,
        resume_choice as resume_choice,
    )
    from ddpkit.checkpoint.publishing.export import export_checkpoint as export_checkpoint
    from ddpkit.checkpoint.publishing.remote_source import (
        local_checkpoint as local_checkpoint,
        remote_root as remote_root,
    )
    from ddpkit.checkpoint.publishing.transfer import TransferReport as TransferReport, apply_transfer as apply_transfer
    from ddpkit.checkpoint.remote.store import is_remote as is_remote, missing_library as missing_library
    from ddpkit.checkpoint.remote.transfer import (
        fetch_checkpoint as fetch_checkpoint,
        remote_checkpoints as remote_checkpoints,
        upload_checkpoint as upload_checkpoint,
    )
    from ddpkit.checkpoint.rng import seed_everything as seed_everything


def __getattr__(name: str) -> Any:
    # Imported on first use: ddpkit.train.config (and so `ddpkit --help`) reads the options without torch.
    if name in _PUBLIC:
        return getattr(importlib.import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module 'ddpkit.checkpoint' has no attribute {name!r}")
