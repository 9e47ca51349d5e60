"""Sharded checkpoints: every rank writes its own shards of the model and the optimizer; rank 0 completes the folder.

A model prepared with ``shard=True`` (FSDP2) holds on each rank only its
shard of every parameter and of the optimizer's state; no rank ever holds the
full model to save or to load it. Its checkpoint is the same verified folder
as any other (:mod:`ddpkit.checkpoint.format`), with the model and optimizer
written by torch.distributed.checkpoint (DCP) instead of ``model.pt`` and
``optimizer.pt``::

    step-000000120/
      .metadata          DCP's index: which tensor, which slice, in which file (rank 0)
      __0_0.distcp       rank 0's shards of the model's and optimizer's tensors
      __1_0.distcp       rank 1's ...
      scheduler.pt ...   every other object, as in any checkpoint (rank 0)
      train.pt rng.pt    the counters, every rank's RNG states
      manifest.json      last: size and SHA-256 of every file above, "sharded": what DCP holds

How a write stays atomic (a collective):

1. rank 0 makes a hidden staging folder ``.step-000000120.tmp-<id>`` and tells every rank;
2. every rank writes its shards into it (``dcp.save``: fsynced files, the
   index by rank 0 once every rank wrote), hashes the files it wrote, and
   sends their sizes and SHA-256 to rank 0;
3. rank 0 writes the other files and the manifest last, then renames the
   folder into place (:func:`ddpkit.checkpoint.format.finish_checkpoint`).

A crash before the rename leaves only the hidden folder, never resumed and
removed by the next pruning. Resuming verifies every file against the
manifest (rank 0) before any rank reads; each rank then reads the slices of
its own shards (``dcp.load``), at the world size that wrote the checkpoint
or at any other (DCP reshards). DCP's index (``.metadata``) is a pickle,
and its non-tensor entries are pickles loaded unrestricted by torch: ddpkit
reads both through unpicklers that refuse anything that could run code
(:class:`SafeReader`, :class:`SafeLoadPlanner`), as it loads any checkpoint
file with ``weights_only=True``. Models and optimizers are taken through
torch's ``get_state_dict``/``set_state_dict`` (keys by parameter name, not
by position), so a plain or DDP model can resume a sharded checkpoint too.
"""

from __future__ import annotations

import hashlib
import io
import os
import pickle
import shutil
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader

from ddpkit.checkpoint.format import CheckpointError, folder_mode
from ddpkit.checkpoint.ranks import on_rank_zero
from ddpkit.checkpoint.storage import StorageError, explain_write_error
from ddpkit.comm.fsdp import is_sharded

__all__ = [
    "SHARDED_KEY",
    "SafeLoadPlanner",
    "SafeReader",
    "ShardedState",
    "refused",
    "sharded_names",
    "sharded_state",
    "unreadable",
]

SHARDED_KEY = "sharded"
"""The manifest's key for what DCP holds: ``{"format": ..., "objects": ["model", "optimizer"]}``."""
_FORMAT = "torch.distributed.checkpoint"
_CHUNK = 1 << 20


class ShardedState:
    """The model (and optimizer) of a sharded run, saved and loaded by every rank through DCP.

    Args:
        model: the model (sharded by FSDP2, or plain to load a sharded checkpoint into).
        optimizer: its optimizer, or None.
        rank: this process's rank.
        world_size: the number of ranks.
    """

    def __init__(self, model: nn.Module, optimizer: Any, rank: int, world_size: int) -> None:
        self.model, self.optimizer = model, optimizer
        self.rank, self.world_size = rank, world_size
        self.names = ("model", "optimizer") if optimizer is not None else ("model",)
        """The Checkpointer's objects whose state DCP holds (the others are files of their own)."""
        self.staged: tuple[Path, dict[str, dict[str, Any]]] | None = None
        """Rank 0, after :meth:`save`: the staging folder and the size and SHA-256 of every file DCP wrote."""

    def facts(self) -> dict[str, Any]:
        """The manifest's entry for what DCP holds."""
        return {SHARDED_KEY: {"format": _FORMAT, "objects": list(self.names), "world_size": self.world_size}}

    def save(self, root: Path, name: str, mode: int, needed_bytes: Callable[[], int]) -> None:
        """Every rank writes its shards into a new staging folder (a collective); see the module docstring.

        Args:
            root: the checkpoints folder.
            name: the checkpoint's folder name.
            mode: permission bits of the files.
            needed_bytes: the expected size of a checkpoint, for a failed write's message.

        Raises:
            StorageError: some rank could not write its shards (on every rank; the staging folder is removed).
        """
        from torch.distributed.checkpoint.api import CheckpointException
        from torch.distributed.checkpoint.filesystem import FileSystemWriter
        from torch.distributed.checkpoint.state_dict_saver import save

        def make_staging() -> str:
            root.mkdir(parents=True, exist_ok=True, mode=folder_mode(mode))
            folder = root / f".{name}.tmp-{uuid.uuid4().hex[:8]}"
            folder.mkdir(mode=folder_mode(mode))
            os.chmod(folder, folder_mode(mode))
            return str(folder)

        staging = Path(on_rank_zero(make_staging, self.rank, self.world_size))
        writer = FileSystemWriter(staging, single_file_per_rank=True, sync_files=True, overwrite=False)
        try:
            save(self._state(), storage_writer=writer)
        except CheckpointException as e:  # DCP raises it on every rank, with each failed rank's error
            if self.rank == 0:
                shutil.rmtree(staging, ignore_errors=True)
            errors = [failure[0] for failure in e.failures.values()]
            error = next((x for x in errors if isinstance(x, OSError)), None)
            if error is None:
                error = OSError(f"rank(s) {sorted(e.failures)} failed: {errors[0] if errors else e}")
            raise StorageError(explain_write_error(root, name, error, needed_bytes())) from None
        # Each rank hashes the files it wrote (in parallel; none reads another's), rank 0 gathers the digests.
        mine = {p.name: _digest(p, mode) for p in sorted(staging.glob(f"__{self.rank}_*"))}
        if self.rank == 0:
            mine.update({p.name: _digest(p, mode) for p in sorted(staging.iterdir()) if not p.name.startswith("__")})
        gathered: list[Any] = [mine]
        if self.world_size > 1:
            gathered = [None] * self.world_size if self.rank == 0 else []
            dist.gather_object(mine, gathered if self.rank == 0 else None, dst=0)
        if self.rank == 0:
            files = {file: facts for part in gathered for file, facts in part.items()}
            self.staged = (staging, files)

    def load(self, path: Path) -> None:
        """Every rank reads its slices of the model's (and optimizer's) state from ``path`` (a collective).

        Raises:
            CheckpointError: the checkpoint's tensors do not fit this run's model or optimizer.
        """
        from torch.distributed.checkpoint.api import CheckpointException
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict
        from torch.distributed.checkpoint.state_dict_loader import load

        state = self._state()
        try:
            load(state, storage_reader=SafeReader(str(path)), planner=SafeLoadPlanner())
            set_model_state_dict(self.model, state["model"])
            if self.optimizer is not None:
                set_optimizer_state_dict(self.model, self.optimizer, state["optimizer"])
        except CheckpointException as e:  # raised on every rank, with each failed rank's error
            raise CheckpointError(unreadable(path, e)) from None
        except pickle.UnpicklingError as e:  # without a process group DCP raises it as it is
            raise CheckpointError(refused(path, e)) from None
        except (RuntimeError, ValueError, KeyError) as e:
            detail = "; ".join(line.strip() for line in str(e).strip().splitlines() if line.strip())[:500]
            raise CheckpointError(
                f"checkpoint {path}: its sharded model or optimizer does not fit this run's ({detail}); resume "
                "with the model and optimizer it was written with, or start a new run in another folder"
            ) from None

    def _state(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        state: dict[str, Any] = {"model": get_model_state_dict(self.model)}
        if self.optimizer is not None:
            state["optimizer"] = get_optimizer_state_dict(self.model, self.optimizer)
        return state


def sharded_state(objects: Mapping[str, Any], rank: int, world_size: int) -> ShardedState | None:
    """The state of ``objects``' model (and optimizer) when the model is sharded (``prepare_model(shard=True)``)."""
    if not is_sharded(objects.get("model")):
        return None
    return ShardedState(objects["model"], objects.get("optimizer"), rank, world_size)


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


def sharded_names(manifest: dict[str, Any]) -> tuple[str, ...]:
    """The objects a checkpoint holds in DCP's files (none for a checkpoint of a replicated model)."""
    entry = manifest.get(SHARDED_KEY) or {}
    return tuple(entry.get("objects", ()))


def _digest(path: Path, mode: int) -> dict[str, Any]:
    """Size and SHA-256 of a file DCP wrote, read in chunks (bounded memory); its mode set to ``mode``."""
    os.chmod(path, mode)
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return {"bytes": path.stat().st_size, "sha256": digest.hexdigest()}
