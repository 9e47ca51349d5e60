"""What a ``ddpkit.DataLoader`` over a map-style dataset reads: its global order, and the dataset torch's loader reads.

The order is a :class:`~ddpkit.data.sampler.GlobalBatchSampler` (over
node-sharded data, the node's :class:`~ddpkit.data.node_shards.NodeBatchSampler`)
made from ``shuffle``, ``seed`` and a user's ``sampler``
(:func:`~ddpkit.data.arguments.read_sampler`). torch's loader reads the
user's dataset through a reader (:func:`~ddpkit.data.adapters.reader_for`),
except on the TensorDataset fast path: no randomness and no per-sample
Python there, each batch an ``index_select`` per tensor.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch.utils.data import Dataset, TensorDataset

from ddpkit.data.adapters import reader_for
from ddpkit.data.arguments import read_sampler
from ddpkit.data.node_shards import NodeShards
from ddpkit.data.sampler import GlobalBatchSampler
from ddpkit.errors import UserError

__all__ = ["MapStyleSource", "map_style_source"]


@dataclass(frozen=True)
class MapStyleSource:
    """A map-style loader's global order, and the dataset torch's loader reads."""

    sampler: GlobalBatchSampler
    """The global order (a NodeBatchSampler over node-sharded data)."""
    dataset: Dataset[Any]
    """What torch's loader reads: a reader around the user's dataset, or the user's TensorDataset itself."""
    tensor_fast_path: bool
    """True for a TensorDataset read without workers or collate_fn: batches by ``index_select``."""


def map_style_source(
    dataset: Dataset[Any],
    global_batch_size: int,
    rank: int,
    world_size: int,
    drop_last: bool,
    collate_fn: Callable[[list[Any]], Any] | None,
    num_workers: int,
    *,
    shuffle: bool | None,
    sampler: Any,
    seed: int,
    seed_per_sample: bool,
) -> MapStyleSource:
    """The order and the dataset for ``ddpkit.DataLoader``'s arguments (see its docstring for each).

    Raises:
        ValueError: a dataset without ``__len__``, a sampler refused by
            :func:`~ddpkit.data.arguments.read_sampler`, or a sampler over node-sharded data.
    """
    if not hasattr(dataset, "__len__"):
        raise UserError(
            f"ddpkit.DataLoader needs a map-style Dataset (__getitem__ and __len__) or an IterableDataset; "
            f"{type(dataset).__name__} is neither: give it __len__, or make it a torch IterableDataset"
        )
    shuffle, seed, order = read_sampler(sampler, shuffle, seed, len(dataset), rank, world_size)
    global_sampler: GlobalBatchSampler
    if isinstance(dataset, NodeShards):
        if order is not None:
            raise UserError("node-sharded data is read in its own order; pass shuffle= and seed=, not sampler=")
        global_sampler = dataset.batch_sampler(global_batch_size, seed, shuffle, drop_last)
    else:
        global_sampler = GlobalBatchSampler(
            len(dataset), global_batch_size, rank, world_size, seed, shuffle, drop_last=drop_last, order=order
        )
    # TensorDataset has no randomness and needs no per-sample Python: index_select per tensor.
    fast_path = isinstance(dataset, TensorDataset) and collate_fn is None and num_workers == 0
    if not fast_path:
        dataset = reader_for(dataset, collate_fn)(dataset, seed, seed_per_sample)
    return MapStyleSource(global_sampler, dataset, fast_path)
