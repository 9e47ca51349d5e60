"""Reading DCP's files safely: its index and non-tensor entries are pickles, and nothing in them may run code.

DCP's index (``.metadata``) is a pickle, and torch loads the non-tensor
entries of its shards with ``torch.load(weights_only=False)``. ddpkit reads
both through unpicklers that refuse anything that could run code
(:class:`SafeReader`, :class:`SafeLoadPlanner`), as it loads any checkpoint
file with ``weights_only=True``; :func:`refused` and :func:`unreadable` are
the one-line errors.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader

__all__ = ["SafeLoadPlanner", "SafeReader", "refused", "unreadable"]


def refused(path: Path, error: BaseException) -> str:
    """The message for a checkpoint whose DCP files hold what could run code."""
    return (
        f"refused to load {path}: its DCP files hold objects other than tensors, plain containers and DCP's "
        f"own index ({str(error).strip().splitlines()[0] if str(error).strip() else 'unsupported content'}); "
        "ddpkit never runs code from a checkpoint. Use a checkpoint written by ddpkit"
    )


def unreadable(path: Path, error: BaseException) -> str:
    """The message for DCP's CheckpointException: a refused pickle (our unpicklers' words), or the first error."""
    from torch.distributed.checkpoint.api import CheckpointException

    errors = [failure[0] for failure in error.failures.values()] if isinstance(error, CheckpointException) else []
    for failure in errors:
        if isinstance(failure, pickle.UnpicklingError) or _NOT_ALLOWED in str(failure):
            parts = str(failure).split("; ")
            detail = next((part for part in parts if _NOT_ALLOWED in part), parts[0])
            return refused(path, pickle.UnpicklingError(detail.split("failed: ")[-1]))
    return f"checkpoint {path} could not be read ({errors[0] if errors else error}); use an earlier checkpoint"


_NOT_ALLOWED = "is not allowed in a checkpoint's index"

_INDEX_TYPES = {
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("collections", "OrderedDict"),
}
"""Globals DCP's index (``.metadata``) may name besides the classes of its own modules and torch's dtypes."""
_INDEX_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem")


class _IndexUnpickler(pickle.Unpickler):
    """Unpickles DCP's index and nothing else: its dataclasses, torch.Size, dtypes, paths (no code to run)."""

    def find_class(self, module: str, name: str) -> Any:
        import torch

        found = (
            super().find_class(module, name) if module.split(".")[0] in ("torch", "pathlib", "collections") else None
        )
        if (module, name) in _INDEX_TYPES:
            return found
        if module in _INDEX_MODULES and isinstance(found, type):
            return found
        if module == "torch" and isinstance(found, torch.dtype):
            return found
        raise pickle.UnpicklingError(f"global '{module}.{name}' {_NOT_ALLOWED}")


class SafeReader(FileSystemReader):
    """DCP's file reader, whose index (``.metadata``, a pickle) is read by an unpickler that runs no code."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        from torch.distributed.checkpoint.metadata import StorageMeta

        with open(Path(self.path) / ".metadata", "rb") as f:
            metadata = _IndexUnpickler(f).load()
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = getattr(self, "load_id", None)
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner, whose non-tensor entries (``torch.load(weights_only=False)`` in torch's) must pass
    ``weights_only=True`` first."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        import torch

        torch.load(value, weights_only=True)  # raises UnpicklingError on anything but plain values
        value.seek(0)
        super().load_bytes(read_item, value)
