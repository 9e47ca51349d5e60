"""The full weights of a sharded checkpoint, read a tensor at a time, for ``ddpkit export``.

A sharded checkpoint (:mod:`ddpkit.checkpoint.sharded.state`) holds each parameter
in slices, one per rank that wrote it. Export reads them back in one process,
without a process group, tensor by tensor in groups of at most
:data:`GROUP_BYTES`: each tensor is assembled in place in a file-backed
buffer (``torch.from_file``, shared mapping) under a temporary folder, so the
process's own (anonymous) memory stays about one group whatever the model's
size; the weights pass through the page cache, which the kernel can write
back and reclaim. ``torch.save`` then writes ``model.pt`` from those buffers:
torch's format, which ``torch.load(weights_only=True)``, ``load_exported``
and ``init_from`` read as they read any export.
"""

from __future__ import annotations

import contextlib
import pickle
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch

from ddpkit.checkpoint.disk.format import CheckpointError
from ddpkit.checkpoint.disk.sharded_reading import SafeLoadPlanner, SafeReader, refused, unreadable

__all__ = ["GROUP_BYTES", "full_weights", "sharded_weights"]

GROUP_BYTES = 256 << 20
"""Bytes of tensors read by one ``dcp.load`` (fewer calls, each re-reading the checkpoint's index)."""
_PREFIX = "model."


@contextlib.contextmanager
def sharded_weights(checkpoint: Path, scratch: Path) -> Iterator[dict[str, torch.Tensor]]:
    """The model's full state_dict from a sharded checkpoint, as file-backed tensors under ``scratch``.

    Args:
        checkpoint: a verified sharded checkpoint folder.
        scratch: an empty folder for the buffers (removed by the caller once the weights are written).

    Yields:
        Parameter and buffer name -> full tensor (valid inside the block).

    Raises:
        CheckpointError: the checkpoint's model holds entries other than tensors.
    """
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    try:
        metadata = SafeReader(str(checkpoint)).read_metadata()
    except pickle.UnpicklingError as e:
        raise CheckpointError(refused(checkpoint, e)) from None
    state: dict[str, torch.Tensor] = {}
    group: dict[str, torch.Tensor] = {}
    group_bytes = 0
    for key, entry in metadata.state_dict_metadata.items():
        if not key.startswith(_PREFIX):
            continue  # the optimizer's state stays behind
        name = key[len(_PREFIX) :]
        if not isinstance(entry, TensorStorageMetadata):
            raise CheckpointError(
                f"checkpoint {checkpoint}: the model's {name} is not a tensor; export supports tensor state only"
            )
        dtype, numel = entry.properties.dtype, entry.size.numel()
        path = scratch / f"{len(state):06d}.bin"
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        tensor = torch.from_file(str(path), shared=True, size=numel, dtype=dtype).view(entry.size)
        state[name] = group[name] = tensor
        group_bytes += nbytes
        if group_bytes >= GROUP_BYTES:
            _load(checkpoint, group)
            group, group_bytes = {}, 0
    if group:
        _load(checkpoint, group)
    yield state


def full_weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    """The model's full state_dict from a sharded checkpoint, in memory (``init_from``: for a full model)."""
    with tempfile.TemporaryDirectory(prefix="ddpkit-weights-") as scratch:
        with sharded_weights(checkpoint, Path(scratch)) as state:
            return {name: tensor.clone() for name, tensor in state.items()}


def _load(checkpoint: Path, group: dict[str, torch.Tensor]) -> None:
    """Fill ``group``'s tensors in place from the checkpoint's slices (one process, no process group)."""
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict_loader import load

    with warnings.catch_warnings():  # "torch.distributed is ... uninitialized": one process is the intent
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        try:
            load({"model": group}, storage_reader=SafeReader(str(checkpoint)), planner=SafeLoadPlanner(), no_dist=True)
        except (pickle.UnpicklingError, CheckpointException) as e:
            raise CheckpointError(
                refused(checkpoint, e) if isinstance(e, pickle.UnpicklingError) else unreadable(checkpoint, e)
            ) from None
