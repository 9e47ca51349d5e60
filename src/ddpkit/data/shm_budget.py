"""Shared memory a DataLoader's worker processes hold, checked before they start.

torch hands every tensor a worker process returns to the training process
through a file in /dev/shm, and each worker prepares ``prefetch_factor``
batches ahead; every training process of the node does the same. Before a
loader starts its workers, :func:`warn_if_too_small` estimates that from
one sample (read in this process, its generators restored) and warns in one
line, naming the fix, when /dev/shm cannot hold it. torch itself then fails
with a long traceback (``unable to allocate shared memory``), or a worker
dies of SIGBUS; :func:`translate` turns either into one
:class:`~ddpkit.env.shared_memory.SharedMemoryError` line with the sizes and
the fix. See :mod:`ddpkit.env.shared_memory`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ddpkit import distributed
from ddpkit.env import shared_memory
from ddpkit.log import get_logger

try:
    import numpy as np
except ImportError:  # numpy is optional for torch, and so here
    np = None  # type: ignore[assignment]  # a module or None: every use checks for None first

_NUMBER_BYTES = 8
"""A Python number in a sample: default_collate makes a float64 or int64 tensor of it."""

_OUT_OF_SHM_MARKERS = ("shared memory", "Bus error")
"""Texts of torch's errors when a worker cannot put a batch into /dev/shm (SIGBUS in older torch)."""


def sample_bytes(sample: Any) -> int:
    """Bytes of the tensors, arrays and numbers in one sample, as a batch holds them per sample."""
    if isinstance(sample, torch.Tensor):
        return sample.numel() * sample.element_size()
    if np is not None and isinstance(sample, np.ndarray):
        return sample.nbytes
    if isinstance(sample, (int, float, bool)):
        return _NUMBER_BYTES
    if isinstance(sample, Mapping):
        return sum(sample_bytes(value) for value in sample.values())
    if isinstance(sample, (list, tuple)):
        return sum(sample_bytes(value) for value in sample)
    return 0  # strings and other objects travel pickled, not in shared memory


def need_bytes(loader: torch.utils.data.DataLoader[Any], one_sample_bytes: int, batch_size: int) -> tuple[int, int]:
    """(bytes of /dev/shm the loaders like ``loader`` of this node hold, training processes on this node)."""
    _, local_world_size = distributed.local_ranks()
    per_process = shared_memory.loader_bytes(
        one_sample_bytes * batch_size, loader.num_workers, loader.prefetch_factor or 2, len(loader)
    )
    return per_process * local_world_size, local_world_size


def warn_if_too_small(loader: torch.utils.data.DataLoader[Any], sample: Any, batch_size: int) -> None:
    """Warn in one line (on local rank 0) when /dev/shm cannot hold what the workers of ``loader`` will put there.

    Args:
        loader: a DataLoader about to start its worker processes.
        sample: one sample of its dataset, as a worker returns it before collation.
        batch_size: samples per batch of this process.
    """
    space = shared_memory.measure()
    need, processes = need_bytes(loader, sample_bytes(sample), batch_size)
    if space is None or space.fits(need) or distributed.local_ranks()[0] != 0:
        return
    get_logger().warning(
        shared_memory.too_small(_what(loader, processes), need, space) + "; or lower num_workers or prefetch_factor"
    )


def translate(
    error: RuntimeError, loader: torch.utils.data.DataLoader[Any], one_sample_bytes: int, batch_size: int
) -> Exception:
    """The error to raise for ``error`` from ``loader``'s iteration: one line when /dev/shm ran out, else itself."""
    space = shared_memory.measure()
    if space is None or not any(marker in str(error) for marker in _OUT_OF_SHM_MARKERS):
        return error
    need, processes = need_bytes(loader, one_sample_bytes, batch_size)
    message = shared_memory.too_small(_what(loader, processes), need, space)
    return shared_memory.SharedMemoryError(f"a DataLoader worker ran out of shared memory: {message}")


def _what(loader: torch.utils.data.DataLoader[Any], processes: int) -> str:
    ahead = loader.num_workers * (loader.prefetch_factor or 2)
    return (
        f"a DataLoader with {loader.num_workers} worker processes ({ahead} batches ahead) in each of "
        f"{processes} training processes of this node"
    )
