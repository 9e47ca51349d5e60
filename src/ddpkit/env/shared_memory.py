"""How much shared memory (/dev/shm) this node has, and whether what ddpkit puts there fits.

Two things of ddpkit's live in /dev/shm, a tmpfs that the processes of one
node (one container) share:

- the shared-memory all_reduce's segment, one per node (per process group),
  a few MiB: :func:`ddpkit.comm.shm.segment_bytes`;
- the batches a DataLoader's worker processes hand to the training process:
  torch puts every tensor a worker returns into a shared-memory file, and
  ``num_workers * prefetch_factor`` batches wait ahead of the loop, on every
  training process of the node.

A container runtime gives a container its own /dev/shm of 64 MB unless told
otherwise (``docker run --shm-size``, or ``--ipc=host`` for the host's). When
it is too small, the all_reduce falls back to gloo's (``allreduce=auto``) or
is refused before any worker starts (``allreduce=shm``), and a DataLoader
warns before its workers start and turns torch's out-of-shared-memory error
into one line (:mod:`ddpkit.data.loader`); each says the fix, :data:`FIX`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from ddpkit.errors import UserError

SHM_DIR = "/dev/shm"
"""Where POSIX shared memory (shm_open) and torch's shared tensors live on Linux."""

FIX = "start the container with --shm-size=1g (docker run, podman run), or --ipc=host to share the host's /dev/shm"
"""The fix for a /dev/shm too small, named by every message about it."""

LOOP_HELD_BATCHES = 2
"""Batches of a DataLoader held in shared memory besides those prefetched: the one the loop works on and the
previous one, freed only when the loop variable takes the next."""


class SharedMemoryError(UserError):
    """/dev/shm is too small for what the job puts there; the message names the sizes and :data:`FIX`."""


@dataclass(frozen=True)
class SharedMemory:
    """The size of /dev/shm, read at one moment."""

    path: str
    """The folder measured, normally /dev/shm."""
    total_bytes: int
    """Its size: the tmpfs's limit."""
    free_bytes: int
    """What is left of it for this process (other processes' files count against it)."""

    def fits(self, need_bytes: int) -> bool:
        """Whether ``need_bytes`` more fit now."""
        return need_bytes <= self.free_bytes

    def describe(self) -> str:
        """E.g. "/dev/shm has 60.1 MiB free of 64.0 MiB"."""
        return f"{self.path} has {mib(self.free_bytes)} free of {mib(self.total_bytes)}"


def measure(path: str = SHM_DIR) -> SharedMemory | None:
    """The size and free space of ``path`` now, or None where it does not exist (not Linux).

    Args:
        path: the shared-memory folder.
    """
    try:
        stat = os.statvfs(path)
    except OSError:
        return None
    return SharedMemory(path, stat.f_blocks * stat.f_frsize, stat.f_bavail * stat.f_frsize)


def loader_bytes(batch_bytes: int, num_workers: int, prefetch_factor: int, num_batches: int) -> int:
    """Shared memory one DataLoader with worker processes holds at most: its prefetched and held batches.

    Args:
        batch_bytes: bytes of one batch's tensors (on this rank).
        num_workers: the loader's worker processes (0: none, nothing in shared memory).
        prefetch_factor: batches each worker prepares ahead (torch's default: 2).
        num_batches: batches in an epoch: no more than these are ever in flight.
    """
    if num_workers == 0:
        return 0
    return batch_bytes * min(num_batches, num_workers * prefetch_factor + LOOP_HELD_BATCHES)


def too_small(what: str, need_bytes: int, space: SharedMemory) -> str:
    """One line: what needs how much, what /dev/shm has, and :data:`FIX`.

    Args:
        what: who needs it, e.g. "the shared-memory all_reduce of 2 workers".
        need_bytes: how much it needs.
        space: /dev/shm as measured.
    """
    return f"{what} needs about {mib(need_bytes)} of shared memory but {space.describe()}; {FIX}"


def mib(num_bytes: float) -> str:
    """``num_bytes`` in MiB with one decimal, e.g. "64.0 MiB"."""
    return f"{num_bytes / (1 << 20):.1f} MiB"
