"""How ddpkit.DataLoader reads a dataset: per sample, one batch per call, or collated by the dataset.

A TensorDataset with torch's collate and no workers is read by indexing
(:func:`tensor_batches`). Otherwise the loader wraps the user's dataset in a :class:`~ddpkit.data.sample_seeds.SeededDataset`
(per-sample seeding), or in one of the batch readers below when the dataset
reads a batch in one call; :class:`Collate` then makes the batch, passing on
one the dataset collated itself, and gives an empty share a batch of zero rows.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from types import ModuleType
from typing import Any

import torch
from torch.utils.data import Dataset, TensorDataset

from ddpkit.data.arrow import arrow_batch_reader
from ddpkit.data.sample_seeds import SeededDataset, _mix, _Template
from ddpkit.data.sampler import GlobalBatchSampler

np: ModuleType | None
try:
    import numpy as np
except ImportError:  # numpy is optional for torch, and so here
    np = None

__all__ = ["ArrowBatchDataset", "BatchReadDataset", "Collate", "reader_for", "tensor_batches", "zero_rows"]


class Collate:
    """The user's collate_fn, and zero-row batches for empty shares."""

    def __init__(self, collate_fn: Callable[[list[Any]], Any]):
        self.collate_fn = collate_fn

    def __call__(self, samples: list[Any]) -> Any:
        first = samples[0]
        if type(first) is _Template:
            sample = first.sample
            return zero_rows(sample.batch if type(sample) is _Collated else self.collate_fn([sample]))
        if type(first) is _Collated:
            return first.batch
        return self.collate_fn(samples)


class _Collated:
    """A batch the dataset read already collated (:class:`ArrowBatchDataset`): the collate step passes it on."""

    __slots__ = ("batch",)

    def __init__(self, batch: Any):
        self.batch = batch


class BatchReadDataset(SeededDataset):
    """A dataset with a ``__getitems__`` of its own, read one batch per call, as torch's loader reads it.

    A Hugging Face ``datasets.Dataset`` reads a batch of rows in one Arrow
    call (its transforms run on the batch); one ``dataset[index]`` per sample
    would cost several times more. Per-sample seeding cannot reach inside one
    call, so with ``seed_per_sample`` the generators are seeded once per
    batch from (seed, epoch, the batch's first index): draws are reproducible,
    and a resume at the same world size exact, but they depend on how the
    global batch is split among ranks. Only how a batch is read and seeded
    differs from :class:`SeededDataset`, which saves and restores the
    generators around it in the training process.
    """

    def _unseeded(self, keys: Sequence[tuple[int, int, bool]]) -> list[Any]:
        """The samples of one batch's keys, from one ``dataset.__getitems__`` call."""
        return self._read_batch([index for _, index, _ in keys])

    def _read(self, keys: Sequence[tuple[int, int, bool]]) -> list[Any]:
        """The batch, every generator seeded once from (seed, epoch, the batch's first index)."""
        seed = _mix(_mix(_mix(self.seed) + keys[0][0]) + keys[0][1])
        for generator in self._process_generators():
            generator.seed(seed)
        return self._unseeded(keys)

    def _read_batch(self, indices: list[int]) -> list[Any]:
        dataset: Any = self.dataset  # one with its own __getitems__ (_reads_batches chose this class for it)
        batch: list[Any] = dataset.__getitems__(indices)
        return batch


class ArrowBatchDataset(BatchReadDataset):
    """A Hugging Face ``datasets.Dataset`` in torch format, with torch's default collate: read collated.

    ``dataset[indices]`` is already the batch default_collate would make of
    the rows (a dict of stacked tensors; lists for strings). HF's
    ``__getitems__`` splits it into row dicts, which default_collate then
    stacks again: a third of the loader's time on W1-sized rows. Columns of
    numbers are read straight from Arrow (:mod:`ddpkit.data.arrow`).
    """

    def __init__(self, dataset: Dataset[Any], seed: int, seed_per_sample: bool = True):
        super().__init__(dataset, seed, seed_per_sample)
        # Columns of numbers are read straight from Arrow (ddpkit.data.arrow); others through HF's formatter.
        self.read_columns = arrow_batch_reader(dataset)

    def _read_batch(self, indices: list[int]) -> list[Any]:
        read = self.read_columns
        return [_Collated(read(indices) if read is not None else self.dataset[indices])]


def _arrow_in_torch_format(dataset: Any) -> bool:
    """An HF ``datasets.Dataset`` formatted as torch tensors (without importing ``datasets``)."""
    module = sys.modules.get("datasets")
    return module is not None and isinstance(dataset, module.Dataset) and (dataset.format or {}).get("type") == "torch"


def _reads_batches(dataset: Any) -> bool:
    """True when ``dataset.__getitems__`` reads a batch in one call (an HF Dataset's, a user's own).

    torch's wrappers (Subset, StackDataset) define one that falls back to a
    ``dataset[index]`` per sample: those keep per-sample seeding, unless what
    they wrap reads batches itself.
    """
    method = getattr(type(dataset), "__getitems__", None)
    if method is None:
        return False
    if getattr(method, "__module__", "").startswith("torch.utils.data"):
        inner = getattr(dataset, "dataset", None)
        return inner is not None and _reads_batches(inner)
    return True


def zero_rows(batch: Any) -> Any:
    """``batch`` with every tensor and array cut to ``[:0]``, its structure kept.

    A list of strings (what default_collate makes of string fields) is a
    per-sample list and becomes empty; other leaves are kept as collated.
    """
    if isinstance(batch, torch.Tensor) or (np is not None and isinstance(batch, np.ndarray)):
        return batch[:0]
    if isinstance(batch, Mapping):
        items = {key: zero_rows(value) for key, value in batch.items()}
        mapping_type: Any = type(batch)  # a dict, an OrderedDict, or a Mapping of the dataset's own
        try:
            return mapping_type(items)
        except TypeError:  # a Mapping that cannot be built from a dict, as default_collate falls back
            return items
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # namedtuple
        return type(batch)(*(zero_rows(value) for value in batch))
    if isinstance(batch, (list, tuple)):
        if batch and all(isinstance(value, (str, bytes)) for value in batch):
            return batch[:0]
        return type(batch)(zero_rows(value) for value in batch)
    return batch


def tensor_batches(
    dataset: TensorDataset, sampler: GlobalBatchSampler, epoch: int, start: int
) -> Iterator[tuple[torch.Tensor, ...]]:
    """The loader's fast path for a TensorDataset: this rank's share of each batch by one index_select per tensor."""
    # index_select, not tensor[indices]: advanced indexing of a 4-D tensor costs several times more.
    tensors = dataset.tensors
    devices = {tensor.device for tensor in tensors}
    if len(devices) == 1:
        for indices in sampler.tensor_shares(epoch, start, devices.pop()):
            yield tuple([tensor.index_select(0, indices) for tensor in tensors])
    else:
        for indices in sampler.tensor_shares(epoch, start):
            yield tuple([tensor.index_select(0, indices.to(tensor.device)) for tensor in tensors])


def reader_for(dataset: Any, collate_fn: Callable[[list[Any]], Any] | None) -> type[SeededDataset]:
    """The class that reads ``dataset`` for the loader: per sample, or a batch per call (collated or not)."""
    if not _reads_batches(dataset):
        return SeededDataset
    return ArrowBatchDataset if collate_fn is None and _arrow_in_torch_format(dataset) else BatchReadDataset
