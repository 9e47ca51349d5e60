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
split as evenly as possible (as ``torch.tensor_split`` splits), and
``ddpkit.DataLoader.global_mean`` scales each rank's loss so the gradient is
still the mean over the global batch.

:class:`GlobalBatchSampler` is a ``torch.utils.data.Sampler`` of index lists,
usable as the ``batch_sampler`` of a plain ``torch.utils.data.DataLoader``::

    sampler = GlobalBatchSampler(len(dataset), global_batch_size=256)
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler)
    for epoch in range(sampler.current_epoch, num_epochs):
        sampler.set_epoch(epoch)
        for batch in loader:
            ...

With shuffle=False the order is 0, 1, 2, ...: for evaluation, every sample
exactly once, no padding. When the last global batch has fewer samples than
ranks, some ranks' share is empty and the sampler yields ``[]``, which a plain
DataLoader's default_collate cannot collate; ``ddpkit.DataLoader`` turns it
into a batch with zero rows so every rank runs the same number of steps.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator, Mapping, Sized
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import Sampler

from ddpkit.errors import UserError


def epoch_permutation(num_samples: int, seed: int, epoch: int) -> torch.Tensor:
    """The global sample order of ``epoch``: identical on every rank and every world size."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(num_samples, generator=generator)


class GlobalBatchSampler(Sampler[list[int]]):
    """Yields this rank's sample indices of each global batch of an epoch.

    The position is (epoch, step): ``set_epoch`` chooses the epoch,
    ``load_state_dict`` restores a saved position, at any world size, in O(1).
    A pass over the sampler starts at the position's step and consumes it:
    the next pass over the same epoch starts at step 0 again.

    Args:
        num_samples: size of the dataset.
        global_batch_size: samples per optimizer step, over all ranks.
        rank: this process's rank; by default torch.distributed's, or 0.
        world_size: number of ranks; by default torch.distributed's, or 1.
        seed: seed of the sample order.
        shuffle: False for the order 0, 1, 2, ... (evaluation).
        drop_last: leave out the last global batch when it is incomplete.
        order: the global order of an epoch, ``order(epoch)`` an int64
            tensor of ``len(order)`` dataset indices (a user's sampler drawn
            by :class:`ddpkit.data.order.SamplerOrder`); it replaces the
            permutation and ``num_samples``.

    Raises:
        ValueError: ``global_batch_size`` is not a positive multiple of
            ``world_size``, or ``rank`` is not in [0, world_size).
    """

    def __init__(
        self,
        num_samples: int,
        global_batch_size: int,
        rank: int | None = None,
        world_size: int | None = None,
        seed: int = 0,
        shuffle: bool = True,
        drop_last: bool = False,
        order: (Callable[[int], torch.Tensor] | Sized) | None = None,
    ):
        super().__init__()
        initialized = dist.is_available() and dist.is_initialized()
        if world_size is None:
            world_size = dist.get_world_size() if initialized else 1
        if rank is None:
            rank = dist.get_rank() if initialized else 0
        if global_batch_size < world_size or global_batch_size % world_size:
            raise UserError(
                f"global batch size {global_batch_size} does not divide among {world_size} workers; "
                f"use a global_batch_size that is a multiple of {world_size}"
            )
        if not 0 <= rank < world_size:
            raise UserError(f"rank {rank} is not in [0, {world_size}); pass a rank below world_size")
        self.order = order
        self.num_samples = len(order) if order is not None else num_samples  # type: ignore[arg-type]
        self.drop_last = drop_last
        self.global_batch_size = global_batch_size
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.shuffle = shuffle
        self._epoch = 0
        self._start_step = 0  # where the next pass begins; consumed by it
        self._step = 0  # global batches of self._epoch yielded so far, for state_dict

    # -- the sample order -------------------------------------------------

    @property
    def steps_per_epoch(self) -> int:
        """Global batches per epoch, the last one possibly partial (left out with ``drop_last``)."""
        if self.drop_last:
            return self.num_samples // self.global_batch_size
        return -(-self.num_samples // self.global_batch_size)

    def __len__(self) -> int:
        """Global batches per epoch (every rank takes part in each)."""
        return self.steps_per_epoch

    def global_batch_length(self, step_in_epoch: int) -> int:
        """Number of samples, over all ranks, in global batch ``step_in_epoch``."""
        start = step_in_epoch * self.global_batch_size
        return min(self.global_batch_size, self.num_samples - start)

    def epoch_order(self, epoch: int) -> torch.Tensor:
        """All sample indices of ``epoch`` in order: the sampler's draw, the permutation, or 0..n-1."""
        if self.order is not None:
            return self.order(epoch)  # type: ignore[operator]
        if self.shuffle:
            return epoch_permutation(self.num_samples, self.seed, epoch)
        return torch.arange(self.num_samples)

    def _share(self, step: int) -> tuple[int, int]:
        # This rank's [start, stop) in the epoch order: the split of torch.tensor_split(batch, world_size).
        first = step * self.global_batch_size
        base, extra = divmod(self.global_batch_length(step), self.world_size)
        start = first + self.rank * base + min(self.rank, extra)
        return start, start + base + (self.rank < extra)

    def epoch(self, epoch: int, start_step: int = 0) -> Iterator[torch.Tensor]:
        """Deprecated (removed in the next release): :meth:`tensor_shares`, which yields the same shares.

        The name read as the epoch number, which ``DataLoader.epoch`` is, not as a generator of batches.
        """
        warnings.warn(
            "GlobalBatchSampler.epoch(epoch, start_step) is now tensor_shares(epoch, start_step); "
            "the old name will be removed in the next release",
            DeprecationWarning,
            stacklevel=2,
        )
        return self.tensor_shares(epoch, start_step)

    # -- the position: Sampler protocol and checkpoints ----------------------

    @property
    def current_epoch(self) -> int:
        """The epoch the next pass iterates (set by ``set_epoch`` or ``load_state_dict``)."""
        return self._epoch

    @property
    def start_step(self) -> int:
        """The global batch the next pass begins at: 0, or the step ``load_state_dict`` restored."""
        return self._start_step

    def set_epoch(self, epoch: int) -> None:
        """Iterate ``epoch`` next.

        A new epoch starts at step 0. The epoch of a position just restored by
        ``load_state_dict`` keeps its step, so a resumed loop
        ``for epoch in range(sampler.current_epoch, n): sampler.set_epoch(epoch)``
        continues mid-epoch.
        """
        if epoch != self._epoch:
            self._epoch, self._start_step = epoch, 0
        self._step = self._start_step

    def _begin(self) -> tuple[int, int]:
        # Read when the first batch is asked for, not when iter() is called: torch's
        # multiprocessing iterator calls iter(batch_sampler) twice and drops the first.
        epoch, start = self._epoch, self._start_step
        self._start_step, self._step = 0, start
        return epoch, start

    def __iter__(self) -> Iterator[list[int]]:
        """This rank's share of each global batch of the current epoch, from the position's step on.

        A share is ``[]`` when the global batch has fewer samples than ranks.
        """
        epoch, start = self._begin()
        for step, share in enumerate(self.shares(epoch, start), start):
            self._step = step + 1
            yield share

    def iter_tensors(self, device: torch.device | str | None = None) -> Iterator[torch.Tensor]:
        """As ``iter(sampler)``, but each share as an int64 tensor, for ``index_select`` on in-memory data.

        Args:
            device: where the indices live; the epoch order is moved there once.
        """
        epoch, start = self._begin()
        for step, share in enumerate(self.tensor_shares(epoch, start, device), start):
            self._step = step + 1
            yield share

    def shares(self, epoch: int, start_step: int = 0) -> Iterator[list[int]]:
        """This rank's indices of each global batch of ``epoch`` from ``start_step`` on, as lists.

        A pure function of its arguments: it neither reads nor moves the position.
        """
        order = self.epoch_order(epoch).tolist()
        for step in range(start_step, self.steps_per_epoch):
            first, stop = self._share(step)
            yield order[first:stop]

    def tensor_shares(
        self, epoch: int, start_step: int = 0, device: torch.device | str | None = None
    ) -> Iterator[torch.Tensor]:
        """As :meth:`shares`, each share an int64 tensor on ``device`` (the epoch order is moved there once).

        A pure function of its arguments: it neither reads nor moves the position.
        """
        order = self.epoch_order(epoch).to(device)
        # The full global batches as rows, this rank's columns, cut into views by one C call:
        # a third of the cost of slicing each step in Python, which shows at ~10 us a step.
        num_full, share = self.num_samples // self.global_batch_size, self.global_batch_size // self.world_size
        rows = order[: num_full * self.global_batch_size].view(num_full, self.global_batch_size)
        yield from rows[start_step:, self.rank * share : (self.rank + 1) * share].unbind(0)
        for step in range(max(start_step, num_full), self.steps_per_epoch):
            first, stop = self._share(step)
            yield order[first:stop]

    def check_state(self, state: Mapping[str, Any]) -> None:
        """Raise ValueError unless ``state`` was saved with this sampler's dataset size, batch, seed and shuffle."""
        for name, fix in (
            ("num_samples", "use the dataset it was saved with"),
            ("global_batch_size", "create the sampler with global_batch_size={}"),
            ("seed", "create the sampler with seed={}"),
            ("shuffle", "create the sampler with shuffle={}"),
            ("drop_last", "create the sampler with drop_last={}"),
        ):
            # States saved before drop_last existed have none: they were saved without it.
            saved = state.get(name, False) if name == "drop_last" else state[name]
            here = getattr(self, name)
            if saved != here:
                raise UserError(
                    f"sampler state was saved with {name}={saved} but this sampler has {name}={here}; "
                    + fix.format(saved)
                )

    def state_dict(self) -> dict[str, Any]:
        """The position, and the parameters that must match to restore it.

        ``step_in_epoch`` counts the global batches of ``epoch`` this sampler
        has yielded. Inside a DataLoader with workers, the sampler runs ahead
        of the loop; save ``ddpkit.DataLoader``'s state, which counts the
        batches handed to the loop.
        """
        return {
            "epoch": self._epoch,
            "step_in_epoch": self._step,
            "num_samples": self.num_samples,
            "global_batch_size": self.global_batch_size,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "drop_last": self.drop_last,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from a saved position, whatever the world size it was saved at.

        A state whose epoch is complete becomes the start of the next epoch.

        Raises:
            ValueError: the state was saved with another dataset size, global
                batch size, seed or shuffle.
        """
        self.check_state(state)
        epoch, step = int(state["epoch"]), int(state["step_in_epoch"])
        assert 0 <= step <= self.steps_per_epoch, f"step_in_epoch {step} of {self.steps_per_epoch}"
        if step == self.steps_per_epoch:
            epoch, step = epoch + 1, 0
        self._epoch, self._start_step, self._step = epoch, step, step


def shard_range(num_samples: int, rank: int, world_size: int) -> tuple[int, int]:
    """The contiguous [start, stop) slice of an evaluation set owned by ``rank``.

    Every sample belongs to exactly one rank, without padding or duplicates.
    """
    # The same split as torch.tensor_split: the first (num_samples % world_size) ranks take one more.
    base, extra = divmod(num_samples, world_size)
    start = rank * base + min(rank, extra)
    return start, start + base + (rank < extra)
