"""Reading DCP's files safely: its index and non-tensor entries are pickles, and nothing in them may run code.

DCP's index (``.metadata``) is a pickle, and torch loads the non-tensor
entries of its shards with ``torch.load(weights_only=False)``. ddpkit reads
both through unpicklers that refuse anything that could run code
(:class:`SafeReader`, :class:`SafeLoadPlanner`), as it loads any checkpoint
file with ``weights_only=True``; :func:`refused` and :func:`unreadable` are
the one-line errors.

The manifest's checksums cover the files, not what the index says of them:
an index may name a file the manifest does not list (a shard deleted and the
manifest edited), or any path at all, which DCP would open. :func:`read_index`
refuses a name that is not a plain file name in the folder, and
:func:`check_index` (run by :func:`ddpkit.checkpoint.disk.format.verify_checkpoint`)
checks that every slice lies in a listed file and loads, so that a sharded
checkpoint which verifies also loads.
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader

from ddpkit.checkpoint.disk.layout import CheckpointError

__all__ = ["INDEX", "SafeLoadPlanner", "SafeReader", "check_index", "corrupt", "read_index", "refused", "unreadable"]

INDEX = ".metadata"
"""DCP's index file in a sharded checkpoint."""


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
    """Unpickles DCP's index and nothing else: its dataclasses, torch.Size, dtypes, paths (no code to run).

    The allow list is checked before anything is imported: naming a module must not import it (an import
    runs the module's code).
    """

    def find_class(self, module: str, name: str) -> Any:
        import torch

        if (module, name) in _INDEX_TYPES:
            return super().find_class(module, name)
        if module in _INDEX_MODULES:
            found = super().find_class(module, name)
            if isinstance(found, type):
                return found
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"global '{module}.{name}' {_NOT_ALLOWED}")


class SafeReader(FileSystemReader):
    """DCP's file reader, whose index (``.metadata``, a pickle) is read by an unpickler that runs no code, and
    refused when it names a file outside the checkpoint's folder (DCP would open any path it names)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        return read_index(Path(self.path), load_id=getattr(self, "load_id", None))


def read_index(folder: Path, load_id: Any = None) -> Any:
    """DCP's index of the sharded checkpoint ``folder``, read without running code, its files checked to be
    plain names of files in ``folder``.

    Raises:
        pickle.UnpicklingError: it names a global other than DCP's index types (:func:`refused` says so).
        CheckpointError: it points at a file outside the folder.
        OSError: it cannot be read.
    """
    from torch.distributed.checkpoint.metadata import StorageMeta

    with open(folder / INDEX, "rb") as f:
        metadata = _IndexUnpickler(f).load()
    if not hasattr(metadata, "storage_data") or not hasattr(metadata, "state_dict_metadata"):
        raise pickle.UnpicklingError(f"{INDEX} holds a {type(metadata).__name__}, not DCP's Metadata")
    for entry in metadata.storage_data.values():
        name = entry.relative_path
        # A plain name: an absolute path or one with a separator or ".." would reach past the folder.
        if not isinstance(name, str) or name in ("", ".", "..") or Path(name).name != name or "\\" in name:
            raise CheckpointError(corrupt(folder, f"names the file {name!r}, outside the checkpoint's folder"))
    if getattr(metadata, "storage_meta", None) is None:
        metadata.storage_meta = StorageMeta()
    metadata.storage_meta.load_id = load_id
    return metadata


def corrupt(folder: Path, problem: str) -> str:
    """The message for a sharded checkpoint whose index does not match its files."""
    return f"checkpoint {folder} is corrupt: its DCP index ({INDEX}) {problem}; use an earlier checkpoint"


def check_index(
    folder: Path, files: Mapping[str, Mapping[str, Any]], load: Callable[[Path, bytes], Any] | None
) -> None:
    """Check that DCP can load the sharded checkpoint ``folder`` whose files verified against its manifest.

    Every slice the index names lies within a file the manifest lists (so a missing shard, or one the
    manifest no longer lists, is found), every tensor's slices cover it, and with ``load`` every slice
    loads (``weights_only=True``) as the tensor of the shape and dtype the index says.

    Args:
        folder: the checkpoint folder.
        files: the manifest's files (name -> size and SHA-256), already verified.
        load: loads one slice (its file, its bytes) as ``torch.load(weights_only=True)`` does, raising
            CheckpointError (:func:`ddpkit.checkpoint.disk.reading.load_file`); every slice is loaded with it, one
            at a time (memory bounded by the largest). None: the slices are not loaded.

    Raises:
        CheckpointError: the index does not match the files, or is refused (see :func:`refused`).
    """
    if INDEX not in files:
        raise CheckpointError(corrupt(folder, "is not listed by its manifest"))
    try:
        metadata = read_index(folder)
    except pickle.UnpicklingError as e:
        raise CheckpointError(refused(folder, e)) from None
    except (EOFError, ValueError, TypeError, AttributeError) as e:
        raise CheckpointError(corrupt(folder, f"is damaged ({e})")) from None
    for index, entry in metadata.storage_data.items():
        listed = files.get(entry.relative_path)
        if listed is None:
            raise CheckpointError(corrupt(folder, f"names {entry.relative_path}, which its manifest does not list"))
        if entry.transform_descriptors or entry.offset < 0 or entry.offset + entry.length > int(listed["bytes"]):
            raise CheckpointError(
                corrupt(folder, f"places {index.fqn} at bytes the file {entry.relative_path} does not hold")
            )
    for fqn, item in metadata.state_dict_metadata.items():
        _check_item(folder, metadata, fqn, item, load)


def _check_item(folder: Path, metadata: Any, fqn: str, item: Any, load: Callable[[Path, bytes], Any] | None) -> None:
    """Check that the index holds ``fqn``'s every slice (and, with ``load``, that each loads as it says)."""
    import torch
    from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

    if not isinstance(item, TensorStorageMetadata):
        chunks: list[Any] = [None]
    else:
        chunks = list(item.chunks)
        if sum(chunk.sizes.numel() for chunk in chunks) != item.size.numel():
            raise CheckpointError(corrupt(folder, f"does not cover the whole of {fqn}"))
    for chunk in chunks:
        entry = metadata.storage_data.get(MetadataIndex(fqn, chunk.offsets if chunk is not None else None))
        if entry is None:
            raise CheckpointError(corrupt(folder, f"has no data for {fqn}"))
        if load is None:
            continue
        with open(folder / entry.relative_path, "rb") as f:
            f.seek(entry.offset)
            data = f.read(entry.length)
        where = f"{fqn} in {entry.relative_path}"
        value = load(folder / entry.relative_path, data)
        if chunk is not None and (
            not isinstance(value, torch.Tensor) or value.shape != chunk.sizes or value.dtype != item.properties.dtype
        ):
            raise CheckpointError(corrupt(folder, f"places {where}, which is not the tensor the index describes"))


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner, whose non-tensor entries (``torch.load(weights_only=False)`` in torch's) must pass
    ``weights_only=True`` first."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        import torch

        torch.load(value, weights_only=True)  # raises UnpicklingError on anything but plain values
        value.seek(0)
        super().load_bytes(read_item, value)
