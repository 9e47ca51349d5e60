"""How ``ddpkit.DataLoader`` reads torch's DataLoader arguments.

``ddpkit.DataLoader`` takes torch's whole signature with torch's meaning,
and ddpkit's additions beside it. This module turns those arguments into
what the loader builds on, and refuses what has no meaning here with one
line naming the ddpkit form:

- the batch: ``batch_size`` per rank, as in torch (the global batch is
  ``batch_size * world_size``, so the batches depend on the world size: one
  line at start-up says so), or ``global_batch_size`` over all ranks (the
  same batches at any world size);
- the order: ``shuffle``, or a user's ``sampler`` (drawn by
  :class:`ddpkit.data.order.SamplerOrder`), or a ``DistributedSampler``,
  whose ``shuffle`` and ``seed`` are taken (ddpkit shards itself);
- the seed: ``seed``, or the ``generator``'s seed (it seeds what ddpkit
  seeds: the order, per-sample randomness and the workers' base seed).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DistributedSampler, SequentialSampler

from ddpkit.data.order import SamplerOrder
from ddpkit.errors import UserError
from ddpkit.log import get_logger


class _TorchDefault(int):
    """torch's default ``batch_size=1``, told apart from a 1 the caller passed."""

    def __repr__(self) -> str:
        return "1"


BATCH_SIZE_DEFAULT = _TorchDefault(1)
"""The default of ``batch_size``: 1 per rank, as torch's; ``is`` tells it from an explicit 1."""

_SAID: set[str] = set()
"""Start-up lines already logged by this process (one line per setting, however many loaders)."""


def rank_and_world(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """``rank`` and ``world_size`` as given, else torch.distributed's, else (0, 1)."""
    initialized = dist.is_available() and dist.is_initialized()
    if world_size is None:
        world_size = dist.get_world_size() if initialized else 1
    if rank is None:
        rank = dist.get_rank() if initialized else 0
    return rank, world_size


def global_batch(batch_size: int | None, global_batch_size: int | None, world_size: int, rank: int) -> int:
    """Samples per step over all ranks, from ``batch_size`` (per rank) or ``global_batch_size``.

    Raises:
        ValueError: both are given, or ``batch_size=None``.
    """
    if global_batch_size is not None:
        if batch_size is not BATCH_SIZE_DEFAULT:
            raise UserError(
                f"batch_size={batch_size} (per rank) and global_batch_size={global_batch_size} (over all ranks) "
                "were both given; pass one of them"
            )
        return global_batch_size
    if batch_size is None:
        raise UserError(
            "batch_size=None (torch's unbatched mode) has no global batches to shard; pass batch_size= (per rank) "
            "or global_batch_size=, and a collate_fn for the samples"
        )
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise UserError(f"batch_size={batch_size!r}: pass a positive int, the samples per rank and step")
    line = (
        f"ddpkit.DataLoader: batch_size={batch_size} is per rank (as in torch), so {world_size} rank(s) make "
        f"global batches of {batch_size * world_size} and the batches change with the world size; "
        f"global_batch_size={batch_size * world_size} keeps them the same at any world size"
    )
    if rank == 0 and line not in _SAID:
        _SAID.add(line)
        get_logger().info(line)
    return batch_size * world_size


def loader_seed(seed: int | None, generator: torch.Generator | None) -> int:
    """The loader's seed: ``seed``, else ``generator.initial_seed()``, else 0.

    The generator's initial seed, not a draw from it: the same on every rank
    that seeded its generator alike, and again after a resume.
    """
    if generator is None:
        return 0 if seed is None else seed
    if seed is not None:
        raise UserError(f"seed={seed} and generator= were both given; pass one of them (generator seeds as seed does)")
    return generator.initial_seed()


def read_sampler(
    sampler: Any, shuffle: bool | None, seed: int, num_samples: int, rank: int, world_size: int
) -> tuple[bool, int, SamplerOrder | None]:
    """(shuffle, seed, order) of the global order that ``shuffle`` and ``sampler`` describe.

    Raises:
        ValueError: ``sampler`` together with ``shuffle=True`` (torch's rule),
            a DistributedSampler of another world size, or a sampler whose
            order cannot be made reproducible.
    """
    if sampler is None:
        return bool(shuffle), seed, None
    if shuffle:
        raise UserError(
            "sampler option is mutually exclusive with shuffle (as in torch); the sampler defines the "
            "order: drop shuffle=True, or drop sampler= for ddpkit's shuffled order"
        )
    if isinstance(sampler, DistributedSampler):
        if (sampler.num_replicas, sampler.rank) != (world_size, rank):
            raise UserError(
                f"DistributedSampler(num_replicas={sampler.num_replicas}, rank={sampler.rank}) but this loader is "
                f"rank {rank} of {world_size}; ddpkit.DataLoader shards by itself: drop the DistributedSampler and "
                "pass shuffle=True"
            )
        return sampler.shuffle, sampler.seed, None
    if type(sampler) is SequentialSampler and len(sampler) == num_samples:
        return False, seed, None  # 0, 1, 2, ...: ddpkit's own order without shuffle, no list to draw
    return False, seed, SamplerOrder(sampler, num_samples, seed)


def refuse_batch_sampler(batch_sampler: Any) -> None:
    """``batch_sampler=`` is refused: ddpkit makes the batches from one global order."""
    if batch_sampler is not None:
        raise UserError(
            f"batch_sampler={type(batch_sampler).__name__} is not taken: ddpkit.DataLoader cuts one global order "
            "into global batches so that resume and any world size work; pass the order as sampler= (a Sampler "
            "of indices) with batch_size= (per rank) or global_batch_size="
        )


def refuse_for_streaming(shuffle: bool | None, sampler: Any, persistent_workers: bool, num_workers: int) -> None:
    """torch's refusals for an IterableDataset, and persistent workers, which would not see a new epoch."""
    if sampler is not None:
        raise UserError(
            f"DataLoader with IterableDataset: expected unspecified sampler option, but got "
            f"sampler={sampler} (as in torch); the stream's own order is used: drop sampler="
        )
    if shuffle:
        raise UserError(
            f"DataLoader with IterableDataset: expected unspecified shuffle option, but got "
            f"shuffle={shuffle} (as in torch); shuffle the stream itself (an HF dataset's "
            ".shuffle(seed=..., buffer_size=...))"
        )
    if persistent_workers and num_workers > 0:
        raise UserError(
            "persistent_workers=True with an IterableDataset: workers kept across epochs would not see "
            "the next epoch or a resumed position; pass persistent_workers=False"
        )
