"""``ddpkit.DataLoader``: a torch DataLoader of global batches that resumes at any world size.

A real ``torch.utils.data.DataLoader`` with torch's arguments and their
meaning (:mod:`ddpkit.data.arguments` reads them: ``batch_size`` per rank,
``sampler``, ``drop_last``, ``generator``...). Over a map-style Dataset its
batch sampler is :class:`~ddpkit.data.sampler.GlobalBatchSampler`: every
optimizer step takes one global batch, split across the ranks, the same
samples in the same order whatever the world size (with ``global_batch_size``;
``batch_size`` is per rank, so the global batch grows with the world size).
The order is a permutation, 0, 1, 2, ..., or a user's sampler drawn from
(seed, epoch) (:mod:`ddpkit.data.order`). An ``IterableDataset`` is sharded
and resumed as :mod:`ddpkit.data.streaming` says. What it adds to torch's
loader:

- ``state_dict()`` / ``load_state_dict()``: the position in batches handed to
  the loop (not the sampler's, which runs ahead with workers' prefetch); load
  it into a loader of another world size or ``num_workers`` and the epoch goes
  on with the samples not seen yet.
- per-sample randomness: inside ``dataset[index]`` the python ``random``,
  numpy and torch CPU generators are seeded from (seed, epoch, index), so an
  augmentation draws the same for a sample at any world size or number of
  workers; with ``num_workers=0`` the generators are restored after each
  batch, so the loop's own draws (dropout) are as if no loader ran.
- a rank whose share of a small last global batch is empty gets a batch with
  zero rows, so every rank runs the same number of steps (the collectives of
  backward need that).
- ``global_mean`` makes the gradient the mean over the global batch, also for
  an uneven last batch. Sum the loss on each rank; DDP (or ddpkit's gradient
  sync) averages gradients over ranks::

      for x, y in loader:
          loss = loader.global_mean(F.cross_entropy(model(x), y, reduction="sum"))
          loss.backward()

- a fast path for a ``TensorDataset`` with the default collate and no
  workers: each batch is one ``index_select`` per tensor, no per-sample Python.

A training loop that resumes::

    loader = ddpkit.DataLoader(dataset, global_batch_size=256, num_workers=2)
    loader.load_state_dict(saved["loader"])          # when resuming
    for epoch in range(loader.epoch, num_epochs):
        loader.set_epoch(epoch)                      # keeps a restored mid-epoch step
        for x, y in loader:
            ...
            saved["loader"] = loader.state_dict()
"""

from __future__ import annotations

import itertools
import multiprocessing.util
import os
import sys
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from types import ModuleType
from typing import Any

import torch
import torch.utils.data
from torch.utils.data import (
    Dataset,
    DistributedSampler,
    IterableDataset,
    Sampler,
    TensorDataset,
    default_collate,
)

from ddpkit.data import shm_budget
from ddpkit.data.arguments import (
    BATCH_SIZE_DEFAULT,
    global_batch,
    loader_seed,
    rank_and_world,
    read_sampler,
    refuse_batch_sampler,
    refuse_for_streaming,
)
from ddpkit.data.arrow import arrow_batch_reader
from ddpkit.data.device import on_device, resolve_loader_device
from ddpkit.data.sample_seeds import SeededDataset, _mix, _Template
from ddpkit.data.sampler import GlobalBatchSampler
from ddpkit.data.streaming import Stream, StreamShard, passed_on
from ddpkit.distributed import worker_device
from ddpkit.errors import UserError
from ddpkit.log import get_logger
from ddpkit.names import DEFAULT_PREEMPT_SIGNALS

np: ModuleType | None
try:
    import numpy as np
except ImportError:  # numpy is optional for torch, and so here
    np = None

__all__ = ["ArrowBatchDataset", "BatchReadDataset", "DataLoader", "SeededDataset"]


class _Collate:
    """The user's collate_fn, and zero-row batches for empty shares."""

    def __init__(self, collate_fn: Callable[[list[Any]], Any]):
        self.collate_fn = collate_fn

    def __call__(self, samples: list[Any]) -> Any:
        first = samples[0]
        if type(first) is _Template:
            sample = first.sample
            return _zero_rows(sample.batch if type(sample) is _Collated else self.collate_fn([sample]))
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


def _kill_workers(iterator: Any) -> None:
    """SIGKILL the worker processes of torch's multiprocessing loader ``iterator`` (none: nothing to do).

    Their pids leave torch's SIGCHLD watch first, which would otherwise raise
    "DataLoader worker is killed" wherever the training process happens to be.
    """
    if getattr(iterator, "_worker_pids_set", False):
        torch._C._remove_worker_pids(id(iterator))  # what torch's signal_handling imports it as
        iterator._worker_pids_set = False
    for worker in getattr(iterator, "_workers", ()):
        worker.kill()


def _zero_rows(batch: Any) -> Any:
    """``batch`` with every tensor and array cut to ``[:0]``, its structure kept.

    A list of strings (what default_collate makes of string fields) is a
    per-sample list and becomes empty; other leaves are kept as collated.
    """
    if isinstance(batch, torch.Tensor) or (np is not None and isinstance(batch, np.ndarray)):
        return batch[:0]
    if isinstance(batch, Mapping):
        items = {key: _zero_rows(value) for key, value in batch.items()}
        mapping_type: Any = type(batch)  # a dict, an OrderedDict, or a Mapping of the dataset's own
        try:
            return mapping_type(items)
        except TypeError:  # a Mapping that cannot be built from a dict, as default_collate falls back
            return items
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # namedtuple
        return type(batch)(*(_zero_rows(value) for value in batch))
    if isinstance(batch, (list, tuple)):
        if batch and all(isinstance(value, (str, bytes)) for value in batch):
            return batch[:0]
        return type(batch)(_zero_rows(value) for value in batch)
    return batch


_LIVE_WORKER_ITERATORS: weakref.WeakSet[Any] = weakref.WeakSet()
"""Iterators of ddpkit loaders that have worker processes (persistent ones live as long as their loader)."""
_WORKER_PROCESSES: weakref.WeakSet[Any] = weakref.WeakSet()
"""The worker processes of ddpkit loaders (multiprocessing holds each until it is joined)."""


def _shut_down_workers_at_exit() -> None:
    """Have this process stop its loaders' workers the orderly way when it exits (once per process).

    The workers ignore SIGTERM (see ``_WorkerInit``), and multiprocessing's
    exit (``atexit`` in a main process; the end of ``_bootstrap`` in a
    multiprocessing child such as a worker of ddpkit's launcher) stops
    daemonic children with SIGTERM and then joins them: a process leaving with
    persistent workers alive (a preemption's SystemExit from inside the loop)
    would wait for them forever. A finalizer with an exit priority runs first,
    and before multiprocessing closes the loaders' index queues (their feeders'
    finalizers have priority 10): torch tells each worker to stop through its
    queue, and on a closed queue the message is lost and torch waits 5 s for
    each worker (20 s for one loader with two, which a restarted round waited).
    """
    global _EXIT_HANDLER_PID
    if _EXIT_HANDLER_PID != os.getpid():  # a forked child starts with no finalizers
        _EXIT_HANDLER_PID = os.getpid()
        multiprocessing.util.Finalize(None, _shutdown_live_workers, exitpriority=20)  # before the queues' 10


def _shutdown_live_workers() -> None:
    for iterator in list(_LIVE_WORKER_ITERATORS):
        iterator._shutdown_workers()
    # A worker that did not stop when asked (torch's fallback, SIGTERM, is ignored: see _WorkerInit) would
    # keep this process waiting at exit for ever: one stuck since its fork, say, after a peer ran out of
    # shared memory. As a daemonic process it is to end with its parent anyway.
    for worker in list(_WORKER_PROCESSES):
        if worker.is_alive():
            worker.kill()
            worker.join()


_EXIT_HANDLER_PID = 0


class _WorkerInit:
    """Each DataLoader worker ignores the signals that stop the training process in an orderly way, and dies
    with it.

    A scheduler's SIGTERM (or a Ctrl-C) reaches every process of the job, the
    loader's workers too; dying of it, a worker would take down the training
    process before it wrote its preemption checkpoint. When the training
    process dies (a rank killed, the launcher stopping a round), Linux kills
    its workers at once (``PR_SET_PDEATHSIG``): torch's own watch of the
    parent notices only within 5 s, and an orphan that exits after the
    launcher has ended runs multiprocessing's finalizers against the
    launcher's removed temporary folder (a ``FileNotFoundError`` traceback
    after a successful run). The kernel ties this to the thread that started
    the worker: iterating a loader from a thread that ends while its workers
    are still wanted (``persistent_workers``) would lose them.
    """

    SIGNALS = DEFAULT_PREEMPT_SIGNALS

    def __init__(self, user_init: Callable[[int], None] | None):
        self.user_init = user_init
        self.parent = os.getpid()  # the training process (the loader starts its workers from it)
        _prctl()  # resolved here: a forked worker must not dlopen (another thread may hold the loader's lock)

    def __call__(self, worker_id: int) -> None:
        import signal

        for name in self.SIGNALS:
            signal.signal(getattr(signal, name), signal.SIG_IGN)
        _die_with_parent(self.parent)
        if self.user_init is not None:
            self.user_init(worker_id)


_PRCTL: list[Any] = []
"""libc's prctl, resolved once in the training process (Linux), inherited by its forked workers."""


def _prctl() -> Any:
    """libc's ``prctl`` (None off Linux), resolved on first use."""
    if not _PRCTL:
        import ctypes

        _PRCTL.append(ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else None)
    return _PRCTL[0]


def _die_with_parent(parent: int) -> None:
    """Linux: have the kernel SIGKILL this process when its parent dies; elsewhere nothing."""
    import signal

    prctl = _prctl()
    if prctl is None:
        return
    pr_set_pdeathsig = 1
    prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:  # it died before the request: nobody would kill this process now
        os._exit(0)


class _KeyBatchSampler(Sampler[list[tuple[int, int, bool]]]):
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


class _LoaderSampler(Sampler[int]):
    """``loader.sampler``: this rank's indices of the loader's epoch; ``set_epoch`` is the loader's.

    The DistributedSampler habit, ``loader.sampler.set_epoch(epoch)``, does
    what ``loader.set_epoch(epoch)`` does. ``sampler`` is the user's sampler
    (None without one).
    """

    def __init__(self, loader: DataLoader, sampler: Any):
        super().__init__()
        self._loader = weakref.ref(loader)  # the loader holds this; no cycle to keep it alive
        self.sampler = sampler

    def _owner(self) -> DataLoader:
        loader = self._loader()
        assert loader is not None, "a loader's sampler is used while the loader lives"
        return loader

    def set_epoch(self, epoch: int) -> None:
        """The loader's :meth:`DataLoader.set_epoch`."""
        self._owner().set_epoch(epoch)

    def __iter__(self) -> Iterator[int]:
        loader = self._owner()
        if loader._sampler is None:
            # A stream has no indices: torch's loader reads this as its _InfiniteConstantSampler.
            yield from itertools.repeat(None)
            return
        for share in loader._sampler.shares(loader.epoch, loader._start_step):
            yield from share

    def __len__(self) -> int:
        loader = self._owner()
        if loader._sampler is None:
            raise TypeError("a loader over an IterableDataset has no length")
        sampler = loader._sampler
        return sum(stop - start for start, stop in map(sampler._share, range(sampler.steps_per_epoch)))


class DataLoader(torch.utils.data.DataLoader[Any]):
    """A ``torch.utils.data.DataLoader`` of this rank's share of each global batch, with torch's arguments.

    Every argument of torch's DataLoader has torch's meaning (the README has
    the table); ddpkit's additions are keyword-only.

    Args:
        dataset: a map-style dataset (``__getitem__`` and ``__len__``), or an
            ``IterableDataset`` (see :mod:`ddpkit.data.streaming`).
        batch_size: samples per rank and step, as in torch: the global batch
            is ``batch_size * world_size``, so the batches depend on the world
            size (one line at start-up says so). Or pass ``global_batch_size``.
        shuffle: True for a new order each epoch, drawn from (seed, epoch);
            False (torch's default) for 0, 1, 2, ... (evaluation: every sample
            once, no padding).
        sampler: a torch Sampler over the dataset's indices whose draw is an
            epoch's global order (see :mod:`ddpkit.data.order`); a
            DistributedSampler gives its ``shuffle`` and ``seed``.
        batch_sampler: refused with one line: pass the order as ``sampler=``.
        drop_last: leave out the last global batch when it is incomplete
            (a stream: each worker's last incomplete batch, as torch).
        generator: its ``initial_seed()`` is the seed (instead of ``seed``).
        num_workers, collate_fn, timeout, worker_init_fn,
            multiprocessing_context, prefetch_factor, persistent_workers,
            pin_memory_device, in_order: as torch's DataLoader.
        pin_memory: as torch's; by default (None) on when the loader places
            batches on a CUDA device, else off.
        global_batch_size: samples per optimizer step over all ranks (a
            multiple of ``world_size``): the same batches at any world size.
        seed: seed of the sample order, of per-sample randomness and of the
            workers' base seed (default 0).
        rank: this process's rank; by default torch.distributed's, or 0.
        world_size: number of ranks; by default torch.distributed's, or 1.
        seed_per_sample: seed the python, numpy and torch CPU generators from
            (seed, epoch, index) before each ``dataset[index]``; False to skip
            (no randomness in ``__getitem__``, or its own generator).
        device: where batches are handed out (:mod:`ddpkit.data.device`):
            "auto" (default) is the worker's CUDA device when ``ddpkit.init``
            chose one (or an nccl group exists), the tensors inside tuples,
            lists, dicts, namedtuples and dataclasses moved from pinned memory,
            the next batch's copy overlapping the current step; on the CPU
            nothing is done. None or "cpu": batches stay as the dataset made
            them. "cuda", "cuda:N" or a torch.device: that CUDA device.

    ``loader.dataset`` is a :class:`SeededDataset` around ``dataset`` (the
    original is ``loader.dataset.dataset``), except on the TensorDataset fast
    path, where it is ``dataset`` itself, and for a stream, where it is a
    :class:`~ddpkit.data.streaming.StreamShard` (``loader.dataset.dataset``).
    ``loader.sampler.set_epoch(n)`` is ``loader.set_epoch(n)``.

    Epochs and the position: the loader is at (``epoch``, ``step_in_epoch``).
    ``set_epoch(n)`` chooses the epoch, in any numbering; a loop that never
    calls it gets a new epoch (a new order) at each complete pass, counted
    from 0. Every iterator made during an epoch starts at the epoch's start,
    or at the restored step after a resume, as torch's loader starts each
    iterator at the epoch's start: a look at ``next(iter(loader))`` before
    the batch loop takes nothing from the loop. The step counts the batches
    handed to the loop by the newest iterator. A loop that never calls
    ``set_epoch`` and leaves a pass early (a ``break`` after two batches or
    more) gets the next epoch at its next pass, as torch's loader reshuffles.
    With a Checkpointer, rank 0 warns once when a loop leaves an epoch early:
    a run resumed inside such an epoch is handed the epoch's remaining batches.

    Raises:
        ValueError: a dataset that is neither map-style nor iterable, a global
            batch that does not divide among ``world_size`` ranks, or an
            argument combination refused (one line naming the ddpkit form).
    """

    def __init__(
        self,
        dataset: Dataset[Any],
        batch_size: int | None = BATCH_SIZE_DEFAULT,
        shuffle: bool | None = None,
        sampler: Sampler[Any] | Iterable[Any] | None = None,
        batch_sampler: Sampler[list[Any]] | Iterable[list[Any]] | None = None,
        num_workers: int = 0,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        pin_memory: bool | None = None,
        drop_last: bool = False,
        timeout: float = 0,
        worker_init_fn: Callable[[int], None] | None = None,
        multiprocessing_context: Any = None,
        generator: torch.Generator | None = None,
        *,
        prefetch_factor: int | None = None,
        persistent_workers: bool = False,
        pin_memory_device: str = "",
        in_order: bool = True,
        global_batch_size: int | None = None,
        seed: int | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        seed_per_sample: bool = True,
        device: torch.device | str | None = "auto",
    ):
        refuse_batch_sampler(batch_sampler)
        self._device = resolve_loader_device(device, worker_device(), torch.cuda.is_available)
        pin_memory = self._device is not None if pin_memory is None else pin_memory
        rank, world_size = rank_and_world(rank, world_size)
        global_batch_size = global_batch(batch_size, global_batch_size, world_size, rank)
        seed = loader_seed(seed, generator)
        torch_arguments = dict(
            num_workers=num_workers,
            pin_memory=pin_memory,
            timeout=timeout,
            worker_init_fn=_WorkerInit(worker_init_fn),
            multiprocessing_context=multiprocessing_context,
            # Drawing the workers' base seed from its own generator, never from torch's global one:
            # a resumed run draws the same dropout masks as an uninterrupted one.
            generator=torch.Generator().manual_seed(seed),
            prefetch_factor=prefetch_factor,
            persistent_workers=persistent_workers,
            pin_memory_device=pin_memory_device,
            in_order=in_order,
        )
        self._sampler: GlobalBatchSampler | None = None
        self._stream: Stream | None = None
        self._follow: DistributedSampler[Any] | None = sampler if isinstance(sampler, DistributedSampler) else None
        self._followed_epoch = self._follow.epoch if self._follow is not None else None
        if isinstance(dataset, IterableDataset):
            refuse_for_streaming(shuffle, sampler, persistent_workers, num_workers)
            self._init_stream(dataset, global_batch_size, rank, world_size, drop_last, collate_fn, torch_arguments)
        else:
            self._init_map_style(
                dataset,
                global_batch_size,
                rank,
                world_size,
                drop_last,
                collate_fn,
                torch_arguments,
                shuffle=shuffle,
                sampler=sampler,
                seed=seed,
                seed_per_sample=seed_per_sample,
            )
        # torch's attributes, read by tools that inspect loaders; torch forbids setting them once built.
        object.__setattr__(self, "sampler", _LoaderSampler(self, sampler))
        object.__setattr__(self, "batch_size", global_batch_size // world_size)
        object.__setattr__(self, "drop_last", drop_last)
        self._rank, self._world_size, self._global_batch_size = rank, world_size, global_batch_size
        self._seed = seed
        self._global_count: int | None = None
        # The position (see "Epochs and the position" in the class docstring).
        self._epoch = 0
        self._start_step = 0
        self._step_in_epoch = 0
        self._epoch_done = False
        self._epochs_set = False
        self._resumed_epoch: int | None = None
        self._pass_batches = 0  # handed out by the newest iterator (a loop's break leaves it short of the epoch)
        self._left_early_said = False
        self.between_batches: Callable[[], None] | None = None
        """Called each time the loop asks for the next batch, and once when the epoch's batches run out:
        the points where the loop's body is complete (the Checkpointer writes its checkpoints there)."""
        self._sample_bytes: int | None = None  # of one sample, read before the workers first start

    def _init_map_style(
        self,
        dataset: Dataset[Any],
        global_batch_size: int,
        rank: int,
        world_size: int,
        drop_last: bool,
        collate_fn: Callable[[list[Any]], Any] | None,
        torch_arguments: dict[str, Any],
        *,
        shuffle: bool | None,
        sampler: Any,
        seed: int,
        seed_per_sample: bool,
    ) -> None:
        if not hasattr(dataset, "__len__"):
            raise UserError(
                f"ddpkit.DataLoader needs a map-style Dataset (__getitem__ and __len__) or an IterableDataset; "
                f"{type(dataset).__name__} is neither: give it __len__, or make it a torch IterableDataset"
            )
        shuffle, seed, order = read_sampler(sampler, shuffle, seed, len(dataset), rank, world_size)
        self._sampler = GlobalBatchSampler(
            len(dataset), global_batch_size, rank, world_size, seed, shuffle, drop_last=drop_last, order=order
        )
        num_workers = torch_arguments["num_workers"]
        # TensorDataset has no randomness and needs no per-sample Python: index_select per tensor.
        self._tensor_fast_path = isinstance(dataset, TensorDataset) and collate_fn is None and num_workers == 0
        if not self._tensor_fast_path:
            reader = SeededDataset
            if _reads_batches(dataset):
                reader = (
                    ArrowBatchDataset if collate_fn is None and _arrow_in_torch_format(dataset) else BatchReadDataset
                )
            dataset = reader(dataset, seed, seed_per_sample)
        torch_arguments["pin_memory"] = torch_arguments["pin_memory"] and not self._tensor_fast_path
        super().__init__(
            dataset,
            batch_sampler=_KeyBatchSampler(self._sampler),
            collate_fn=_Collate(collate_fn or default_collate),
            **torch_arguments,
        )

    def _init_stream(
        self,
        dataset: IterableDataset[Any],
        global_batch_size: int,
        rank: int,
        world_size: int,
        drop_last: bool,
        collate_fn: Callable[[list[Any]], Any] | None,
        torch_arguments: dict[str, Any],
    ) -> None:
        if global_batch_size % world_size:
            raise UserError(
                f"global batch size {global_batch_size} does not divide among {world_size} workers; "
                f"use a global_batch_size that is a multiple of {world_size}"
            )
        self._tensor_fast_path = False
        shard = StreamShard(
            dataset, rank, world_size, global_batch_size // world_size, drop_last, collate_fn or default_collate
        )
        self._stream = Stream(shard, torch_arguments["num_workers"])
        super().__init__(shard, batch_size=None, collate_fn=passed_on, **torch_arguments)

    # -- iteration ----------------------------------------------------------

    # torch annotates its __iter__ as returning its own iterator class; this one hands out a generator over it.
    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        """This rank's batches of the current epoch, from the epoch's start (or restored) step on."""
        follow = self._follow
        if follow is not None and follow.epoch != self._followed_epoch:
            # The script called set_epoch on the DistributedSampler it passed (pytorch/examples' habit).
            self._followed_epoch = follow.epoch
            self.set_epoch(follow.epoch)
        if self._left_early():
            self._say_left_early()
            if not self._epochs_set:  # torch's loader would shuffle anew: the next pass is the next epoch
                self._epoch_done, self._resumed_epoch = True, None
        if self._epoch_done:
            # A new pass: the next epoch when the loop never calls set_epoch, else the same epoch again.
            self._epoch += 0 if self._epochs_set else 1
            self._start_step, self._epoch_done = 0, False
        self._pass_batches = 0
        epoch, start = self._epoch, self._start_step
        self._step_in_epoch = start
        if self._tensor_fast_path:
            return self._hand_out(self._tensor_batches(epoch, start))
        if self._stream is not None:
            self._stream.shard.epoch = epoch
        else:
            key_sampler = self.batch_sampler
            assert isinstance(key_sampler, _KeyBatchSampler), "set by _init_map_style"
            key_sampler.epoch, key_sampler.start = epoch, start
        # Workers' seeds a function of (seed, epoch), so a resumed epoch gets the same ones.
        self.generator.manual_seed(_mix(_mix(self._seed) + epoch))
        if self.num_workers and self._sample_bytes is None and self._stream is None:
            self._check_shared_memory(epoch)  # (a stream's samples cannot be read ahead of its workers)
        batches = super().__iter__()
        if hasattr(batches, "_shutdown_workers"):
            _LIVE_WORKER_ITERATORS.add(batches)
            _WORKER_PROCESSES.update(getattr(batches, "_workers", ()))
            _shut_down_workers_at_exit()
        if self._stream is not None:
            return self._hand_out_stream(batches, epoch, start)
        return self._hand_out(batches)

    def _left_early(self) -> bool:
        """True when the newest pass handed out two batches or more and the loop left it before its end.

        One batch is a look at ``next(iter(loader))``, which takes nothing from the loop.
        """
        return self._pass_batches >= 2 and not self._epoch_done

    def _say_left_early(self) -> None:
        """Rank 0, once, with a Checkpointer: a run resumed inside an epoch the loop leaves early differs."""
        if self._left_early_said or self.between_batches is None or self._rank != 0:
            return
        self._left_early_said = True
        known = self._stream is None or self._stream.known_steps is not None
        total = f" of {self.steps_per_epoch}" if known else ""
        get_logger().warning(
            f"the loop left epoch {self._epoch} after {self._step_in_epoch}{total} batches (a break in its "
            "batch loop): a run resumed from a checkpoint inside such an epoch is handed the epoch's remaining "
            "batches, while the loop's own count (enumerate) starts at 0 again, so it would train other batches "
            "than an uninterrupted run; to train part of each epoch, give the loader only that part, e.g. "
            "sampler=RandomSampler(dataset, num_samples=N), and let its epochs run out"
        )

    def _check_shared_memory(self, epoch: int) -> None:
        """Warn when /dev/shm cannot hold the batches the workers will put there (see ddpkit.data.shm_budget)."""
        sample = self.dataset[(epoch, 0, False)]  # the generators are restored after it
        self._sample_bytes = shm_budget.sample_bytes(sample)
        shm_budget.warn_if_too_small(self, sample, self._rank_batch_size)

    @property
    def _global_sampler(self) -> GlobalBatchSampler:
        """The global order of a map-style loader; a loader over an IterableDataset has a Stream instead."""
        assert self._sampler is not None, "a map-style loader's; a stream has none"
        return self._sampler

    @property
    def _rank_batch_size(self) -> int:
        return self._global_sampler.global_batch_size // self._global_sampler.world_size

    def _shared_memory_error(self, error: RuntimeError) -> Exception:
        """``error`` from torch's iterator, or one line in its place when a worker ran out of /dev/shm."""
        if not self.num_workers:
            return error
        return shm_budget.translate(error, self, self._sample_bytes or 0, self._rank_batch_size)

    def _hand_out(self, batches: Iterator[Any]) -> Iterator[Any]:
        # Counted as the loop receives each batch: workers' prefetch runs the sampler ahead.
        sampler, batches = self._global_sampler, iter(batches)
        placed = on_device(batches, self._device, pin=self._tensor_fast_path)
        while True:
            if self.between_batches is not None:
                self.between_batches()
            try:
                batch = next(placed)
            except StopIteration:
                break
            except RuntimeError as error:
                translated = self._shared_memory_error(error)
                if translated is error:
                    raise
                # Workers blocked on the full /dev/shm do not stop when asked, and ignore SIGTERM (_WorkerInit):
                # torch's shutdown would wait on each in turn. This loader cannot go on: end them now.
                _kill_workers(batches)
                raise translated from error
            self._global_count = sampler.global_batch_length(self._step_in_epoch)
            self._step_in_epoch += 1
            self._pass_batches += 1
            yield batch
        self._epoch_done, self._start_step, self._resumed_epoch = True, 0, None

    def _hand_out_stream(self, batches: Iterator[Any], epoch: int, start: int) -> Iterator[Any]:
        # As _hand_out; each worker's position is kept once its batch reaches the loop.
        stream = self._stream
        assert stream is not None, "a loader over an IterableDataset"
        stream.positions, stream.known_steps = dict(stream.shard.start), None
        agreed = on_device(stream.agreed(iter(batches), epoch, start), self._device, batch_first=True)
        while True:
            if self.between_batches is not None:
                self.between_batches()
            item = next(agreed, None)
            if item is None:
                break
            batch, worker, position, self._global_count, last = item
            stream.positions[worker] = position
            self._step_in_epoch += 1
            self._pass_batches += 1
            if last:
                stream.known_steps = self._step_in_epoch
            yield batch
        stream.known_steps = self._step_in_epoch
        stream.shard.start = {}
        self._epoch_done, self._start_step, self._resumed_epoch = True, 0, None

    def _tensor_batches(self, epoch: int, start: int) -> Iterator[tuple[torch.Tensor, ...]]:
        # index_select, not tensor[indices]: advanced indexing of a 4-D tensor costs several times more.
        dataset = self.dataset
        assert isinstance(dataset, TensorDataset), "the fast path is a TensorDataset's"
        tensors = dataset.tensors
        devices = {tensor.device for tensor in tensors}
        if len(devices) == 1:
            for indices in self._global_sampler.tensor_shares(epoch, start, devices.pop()):
                yield tuple([tensor.index_select(0, indices) for tensor in tensors])
        else:
            for indices in self._global_sampler.tensor_shares(epoch, start):
                yield tuple([tensor.index_select(0, indices.to(tensor.device)) for tensor in tensors])

    def global_mean(self, loss_sum: torch.Tensor) -> torch.Tensor:
        """Scale this rank's summed loss so that averaging gradients over ranks gives the global mean.

        Returns ``loss_sum * world_size / n``, with n the number of samples,
        over all ranks, of the global batch handed out last. A rank with an
        empty share sums to 0 and contributes nothing.

        Raises:
            RuntimeError: no batch has been handed out yet.
        """
        if self._global_count is None:
            raise RuntimeError("global_mean scales the loss of a batch; call it after taking a batch from the loader")
        return loss_sum * (self._world_size / self._global_count)

    # -- position -----------------------------------------------------------

    def set_epoch(self, epoch: int) -> None:
        """Iterate ``epoch`` next (any numbering); right after a resume, the epoch the position continues.

        A new epoch starts at step 0; the epoch of a position just restored
        keeps its step, so ``for epoch in range(start.epoch, n): loader.set_epoch(epoch)``
        continues mid-epoch. ``loader.sampler.set_epoch(epoch)`` is the same call.

        Raises:
            ValueError: right after ``load_state_dict``, an epoch other than the
                one the restored position continues (that loop would skip or
                repeat training).
        """
        if self._resumed_epoch is not None and epoch != self._resumed_epoch:
            raise UserError(self._epoch_mismatch(epoch))
        self._resumed_epoch = None
        self._epochs_set = True
        if epoch != self._epoch:
            if self._left_early():
                self._say_left_early()
            self._epoch, self._start_step, self._step_in_epoch, self._epoch_done = epoch, 0, 0, False
            self._pass_batches = 0
            if self._stream is not None:
                self._stream.shard.start = {}

    def _epoch_mismatch(self, epoch: int) -> str:
        resumed = self._resumed_epoch
        assert resumed is not None, "asked about a resumed loader only"
        if self._start_step:
            where = f"in epoch {resumed} at step {self._start_step} of {self.steps_per_epoch}"
        else:
            where = f"at the start of epoch {resumed}"
        effect = (
            f"epoch {epoch} would be trained again"
            if epoch < resumed
            else f"the rest of epoch {resumed} would be skipped"
        )
        return (
            f"the loader resumed {where} (epochs numbered as the loop passed them to set_epoch), but the "
            f"loop now calls set_epoch({epoch}): {effect}; start the loop at the epoch resume() returns: "
            f"for epoch in range(start.epoch, epochs) (epochs numbered from 1: resume(..., first_epoch=1) "
            f"and range(start.epoch, epochs + 1))"
        )

    @property
    def streaming(self) -> bool:
        """True for a loader over an IterableDataset (its epoch's length is known at its end)."""
        return self._stream is not None

    @property
    def state_dict_is_collective(self) -> bool:
        """True when ``state_dict()`` is a collective (a stream on several ranks): call it on every rank."""
        return self._stream is not None and self._stream.collective

    def state_dict(self) -> dict[str, Any]:
        """The position in batches handed out, and the parameters that must match to restore it.

        ``epoch_done`` is True once the loop has run out of the epoch's
        batches: then the code after the batch loop (a per-epoch scheduler,
        evaluation) may have run, and a restored loader starts the next epoch.
        Before that, a restored loader re-enters the epoch with no batches
        left, so that code runs again, as in the uninterrupted run.

        For a stream on several ranks it gathers every rank's worker positions
        (``state_dict_is_collective``): call it on every rank.
        """
        if self._stream is not None:
            state = {"global_batch_size": self._global_batch_size, "stream": self._stream.state_dict()}
        else:
            state = self._global_sampler.state_dict()
        state.update(epoch=self._epoch, step_in_epoch=self._step_in_epoch, epoch_done=self._epoch_done)
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from a saved position, saved at any world size and number of workers.

        Raises:
            ValueError: the state was saved with another dataset size, global
                batch size, seed, shuffle or drop_last, by a loader of the other
                kind (map-style, stream), or mid-epoch over a stream without state.
        """
        if (self._stream is None) == ("stream" in state):
            kinds = ("an IterableDataset", "a map-style dataset")
            saved, here = kinds if "stream" in state else kinds[::-1]
            raise UserError(
                f"the loader state was saved by a loader over {saved} and this loader reads {here}; "
                "resume with the dataset it was saved with"
            )
        epoch, step = int(state["epoch"]), int(state["step_in_epoch"])
        if self._stream is not None:
            done = bool(state["epoch_done"])
            epoch, step = (epoch + 1, 0) if done else (epoch, step)
            step = self._stream.load_state_dict(state["stream"], epoch, step)
        else:
            self._global_sampler.check_state(state)
            assert 0 <= step <= self.steps_per_epoch, f"step_in_epoch {step} of {self.steps_per_epoch}"
            # Saved before epoch_done existed: an epoch whose batches were all handed out was complete.
            if state.get("epoch_done", step == self.steps_per_epoch):
                epoch, step = epoch + 1, 0
        self._epoch, self._start_step, self._step_in_epoch, self._epoch_done = epoch, step, step, False
        self._resumed_epoch = epoch
        self._global_count = None
        self._pass_batches = 0

    @property
    def epoch(self) -> int:
        """The epoch being (or next to be) iterated, as numbered by ``set_epoch`` (counted from 0 without it)."""
        return self._epoch

    @property
    def step_in_epoch(self) -> int:
        """Batches of ``epoch`` handed out so far (counting those skipped by a resume)."""
        return self._step_in_epoch

    @property
    def epoch_done(self) -> bool:
        """True once the loop has run out of the current epoch's batches."""
        return self._epoch_done

    @property
    def steps_per_epoch(self) -> int:
        """Global batches per epoch, the last one possibly partial.

        For a stream, known once the epoch's last batch has been handed out;
        before that, ``step_in_epoch + 1`` (a batch is read ahead, so at least
        one more follows).
        """
        if self._stream is not None:
            return self._stream.steps_per_epoch(self._step_in_epoch)
        return self._global_sampler.steps_per_epoch

    @property
    def last_global_batch_length(self) -> int:
        """Samples, over all ranks, of the global batch handed out last (0 before the first)."""
        return self._global_count or 0

    @property
    def global_batch_size(self) -> int:
        """Samples per step, over all ranks."""
        return self._global_batch_size

    @property
    def device(self) -> torch.device | None:
        """The CUDA device batches are handed out on, or None: as the dataset (and collate_fn) made them."""
        return self._device

    @property
    def rank(self) -> int:
        """This process's rank."""
        return self._rank

    @property
    def world_size(self) -> int:
        """Number of ranks."""
        return self._world_size
