"""Sharded sampling whose global batches do not depend on the number of workers.

Each epoch draws one permutation of the training set from a generator seeded
by (seed, epoch), cuts it into global batches, and splits every global batch
across the ranks::

    permutation(seed, epoch):  [ 17  3 42  8 | 25  1 30 11 | 9 ... ]
    global batch 0:              17  3 42  8
      world_size 2:    rank 0 -> 17  3      rank 1 -> 42  8
      world_size 1:    rank 0 -> 17  3 42  8

So the samples of a global step, and their order, are the same for every
worker count, and a job resumed with another world size continues exactly
where it stopped. The last global batch may be smaller than the others; it is
split as evenly as possible (``torch.tensor_split``), and training scales each
rank's loss so the gradient is still the mean over the global batch.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch


def epoch_permutation(num_samples: int, seed: int, epoch: int) -> torch.Tensor:
    """The global sample order of ``epoch``: identical on every rank and every world size."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(num_samples, generator=generator)


class GlobalBatchSampler:
    """Yields this rank's sample indices of each global batch of an epoch.

    Args:
        num_samples: size of the training set.
        global_batch_size: samples per optimizer step, over all ranks.
        rank: this process's rank.
        world_size: number of ranks.
        seed: seed of the sample order.

    Raises:
        ValueError: ``global_batch_size`` is not a positive multiple of ``world_size``.
    """

    def __init__(self, num_samples: int, global_batch_size: int, rank: int, world_size: int, seed: int = 0):
        if global_batch_size < world_size or global_batch_size % world_size:
            raise ValueError(
                f"global batch size {global_batch_size} does not divide among {world_size} workers; "
                f"use a multiple of {world_size} (batch_size=...) or batch_scope=per_worker"
            )
        self.num_samples = num_samples
        self.global_batch_size = global_batch_size
        self.rank = rank
        self.world_size = world_size
        self.seed = seed

    @property
    def steps_per_epoch(self) -> int:
        """Global batches per epoch, the last one possibly partial."""
        return -(-self.num_samples // self.global_batch_size)

    def global_batch_length(self, step_in_epoch: int) -> int:
        """Number of samples, over all ranks, in global batch ``step_in_epoch``."""
        start = step_in_epoch * self.global_batch_size
        return min(self.global_batch_size, self.num_samples - start)

    def epoch(self, epoch: int, start_step: int = 0) -> Iterator[torch.Tensor]:
        """This rank's indices for each global batch of ``epoch``, from ``start_step`` on."""
        order = epoch_permutation(self.num_samples, self.seed, epoch)
        for step in range(start_step, self.steps_per_epoch):
            batch = order[step * self.global_batch_size : (step + 1) * self.global_batch_size]
            yield torch.tensor_split(batch, self.world_size)[self.rank]


def shard_range(num_samples: int, rank: int, world_size: int) -> tuple[int, int]:
    """The contiguous [start, stop) slice of an evaluation set owned by ``rank``.

    Every sample belongs to exactly one rank, without padding or duplicates.
    """
    # The same split as torch.tensor_split: the first (num_samples % world_size) ranks take one more.
    base, extra = divmod(num_samples, world_size)
    start = rank * base + min(rank, extra)
    return start, start + base + (rank < extra)
