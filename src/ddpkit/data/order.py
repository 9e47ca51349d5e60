"""The global order of an epoch drawn from any torch Sampler, reproducibly from (seed, epoch).

``ddpkit.DataLoader(dataset, sampler=WeightedRandomSampler(...))`` takes a
user's sampler over the dataset's indices (weighted, class-balanced,
length-grouped, one of their own) as the definition of an epoch's global
order. Each rank draws the whole order itself, with every generator the
sampler may read seeded from (seed, epoch)::

    seed, epoch -> seeds of: the sampler's own generator (sampler.generator),
                             torch's default generator, python's random, numpy's
    list(iter(sampler)) -> [17, 3, 3, 42, ...]   identical on every rank and world size

and the loader cuts it into global batches and shards them, as it does its
own permutation. So a resume at step k of epoch e redraws the same order and
continues at its k-th global batch in O(1), at any world size. The states of
the generators are put back after each draw: the loop's own draws (dropout)
are as if no sampler ran.

A sampler that reads randomness from elsewhere (its own unseeded numpy
``RandomState``, the clock) draws differently twice from the same seeds; it
is refused at construction with one line, since no resume could be exact.
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from typing import Any

import torch

from ddpkit.errors import UserError

try:
    import numpy as np
except ImportError:  # numpy is optional for torch, and so here
    np = None  # type: ignore[assignment]  # a module or None: every use checks for None first

_MASK64 = (1 << 64) - 1


def epoch_seed(seed: int, epoch: int) -> int:
    """A 64-bit seed from (seed, epoch), well spread (splitmix64's finalizer) for every generator."""
    x = (seed * 1_000_003 + epoch + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


class SamplerOrder:
    """``order(epoch)``: the indices a user's sampler yields for ``epoch``, the same on every rank.

    Args:
        sampler: any iterable of dataset indices (a ``torch.utils.data.Sampler``);
            ``set_epoch(epoch)`` is called before each draw where it exists.
        num_samples: the dataset's length; every index must be below it.
        seed: the loader's seed.

    Raises:
        ValueError: the sampler yields something other than indices of the
            dataset, or draws differently twice from the same seeds.
    """

    def __init__(self, sampler: Iterable[int], num_samples: int, seed: int):
        self.sampler, self.num_samples, self.seed = sampler, num_samples, seed
        first = self._draw(0)
        if not torch.equal(first, self._draw(0)):
            raise UserError(
                f"sampler={type(sampler).__name__} draws a different order twice from the same seeds, so no "
                "resume could continue it; draw only from its generator= or torch's, python's or numpy's global "
                "generators (ddpkit seeds them from seed and epoch), or pass shuffle=True without sampler="
            )
        self._cached = (0, first)

    def __len__(self) -> int:
        """Indices per epoch: ``len(sampler)`` (a WeightedRandomSampler's ``num_samples``)."""
        return len(self._cached[1])

    def __call__(self, epoch: int) -> torch.Tensor:
        """The int64 tensor of the indices the sampler yields in ``epoch`` (the last epoch's is kept)."""
        if self._cached[0] != epoch:
            self._cached = (epoch, self._draw(epoch))
        return self._cached[1]

    def _draw(self, epoch: int) -> torch.Tensor:
        sampler, seed = self.sampler, epoch_seed(self.seed, epoch)
        own = getattr(sampler, "generator", None)
        own = own if isinstance(own, torch.Generator) else None
        torch_state, python_state = torch.random.get_rng_state(), random.getstate()
        numpy_state = np.random.get_state() if np is not None else None
        own_state = own.get_state() if own is not None else None
        try:
            torch.default_generator.manual_seed(seed)
            random.seed(seed)
            if np is not None:
                np.random.seed(seed >> 32)
            if own is not None:
                own.manual_seed(seed)
            if hasattr(sampler, "set_epoch"):
                sampler.set_epoch(epoch)
            drawn = list(sampler)
        finally:
            torch.random.set_rng_state(torch_state)
            random.setstate(python_state)
            if numpy_state is not None:
                np.random.set_state(numpy_state)
            if own is not None and own_state is not None:
                own.set_state(own_state)
        return self._indices(drawn)

    def _indices(self, drawn: list[Any]) -> torch.Tensor:
        try:
            order = torch.as_tensor([int(index) for index in drawn], dtype=torch.int64)
        except (TypeError, ValueError):
            raise UserError(
                f"sampler={type(self.sampler).__name__} yields {type(drawn[0]).__name__}s, not dataset indices; "
                "a sampler that yields batches goes nowhere in ddpkit.DataLoader: pass a Sampler of indices as "
                "sampler= with batch_size= (per rank) or global_batch_size="
            ) from None
        if len(order) and not (0 <= int(order.min()) and int(order.max()) < self.num_samples):
            raise UserError(
                f"sampler={type(self.sampler).__name__} yields index {int(order.max())}, but the dataset has "
                f"{self.num_samples} samples; build the sampler over this dataset's indices"
            )
        return order
