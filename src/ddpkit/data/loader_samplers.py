"""The two samplers a ddpkit.DataLoader hands torch: the batches of global keys it reads, and ``loader.sampler``."""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Iterator
from typing import Any, Protocol

from torch.utils.data import Sampler

from ddpkit.data.sampler import GlobalBatchSampler

__all__ = ["KeyBatchSampler", "LoaderSampler"]


class KeyBatchSampler(Sampler[list[tuple[int, int, bool]]]):
    """The GlobalBatchSampler's index lists as SeededDataset keys; an empty share asks for a template.

    The loader sets ``epoch`` and ``start`` before each iteration; ``iter()``
    binds them at once (torch calls it when the loader's iterator is made).
    """

    def __init__(self, sampler: GlobalBatchSampler):
        super().__init__()
        self.sampler = sampler
        self.epoch, self.start = 0, 0

    def __len__(self) -> int:
        return len(self.sampler)

    def __iter__(self) -> Iterator[list[tuple[int, int, bool]]]:
        return self._keys(self.epoch, self.start)

    def _keys(self, epoch: int, step: int) -> Iterator[list[tuple[int, int, bool]]]:
        sampler = self.sampler
        for indices in sampler.shares(epoch, step):
            if indices:
                yield [(epoch, index, False) for index in indices]
            else:
                # Only in a last global batch smaller than world_size: at most once an epoch.
                first = int(sampler.epoch_order(epoch)[step * sampler.global_batch_size])
                yield [(epoch, first, True)]
            step += 1


class _Loader(Protocol):
    """What ``loader.sampler`` asks of its loader (ddpkit.DataLoader)."""

    @property
    def streaming(self) -> bool: ...

    def set_epoch(self, epoch: int) -> None: ...

    def _rank_indices(self) -> Iterator[int]: ...

    def _rank_length(self) -> int: ...


class LoaderSampler(Sampler[int]):
    """``loader.sampler``: this rank's indices of the loader's epoch; ``set_epoch`` is the loader's.

    The DistributedSampler habit, ``loader.sampler.set_epoch(epoch)``, does
    what ``loader.set_epoch(epoch)`` does. ``sampler`` is the user's sampler
    (None without one).
    """

    def __init__(self, loader: _Loader, sampler: Any):
        super().__init__()
        self._loader = weakref.ref(loader)  # the loader holds this; no cycle to keep it alive
        self.sampler = sampler

    def _owner(self) -> _Loader:
        loader = self._loader()
        assert loader is not None, "a loader's sampler is used while the loader lives"
        return loader

    def set_epoch(self, epoch: int) -> None:
        """The loader's ``set_epoch``."""
        self._owner().set_epoch(epoch)

    def __iter__(self) -> Iterator[int]:
        loader = self._owner()
        if loader.streaming:
            # A stream has no indices: torch's loader reads this as its _InfiniteConstantSampler.
            yield from itertools.repeat(None)
            return
        yield from loader._rank_indices()

    def __len__(self) -> int:
        loader = self._owner()
        if loader.streaming:
            raise TypeError("a loader over an IterableDataset has no length")
        return loader._rank_length()
