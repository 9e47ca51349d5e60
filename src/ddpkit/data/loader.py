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
loader (the manual, docs/guides/data.md):

- ``state_dict()`` / ``load_state_dict()``: the position in batches handed to
  the loop (:mod:`ddpkit.data.epochs`), loadable at another world size or
  ``num_workers``; the Checkpointer reads it through :mod:`ddpkit.data.position`;
- per-sample randomness seeded from (seed, epoch, index)
  (:mod:`ddpkit.data.sample_seeds`), and the readers of :mod:`ddpkit.data.adapters`;
- a zero-row batch for a rank whose share of a small last global batch is
  empty, so every rank runs the same steps; ``global_mean`` for the exact
  mean over the global batch;
- batches placed on the worker's GPU (:mod:`ddpkit.data.device`), and worker
  processes that survive a preemption signal and die with their training
  process (:mod:`ddpkit.data.workers`).

A map-style loader's order and reader come from :mod:`ddpkit.data.map_style`;
:mod:`ddpkit.data.hand_out` hands the batches to the loop, step by step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
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
from ddpkit.data.adapters import ArrowBatchDataset, BatchReadDataset, Collate, tensor_batches
from ddpkit.data.agreement import agree_on_order
from ddpkit.data.arguments import (
    BATCH_SIZE_DEFAULT,
    global_batch,
    loader_seed,
    rank_and_world,
    refuse_batch_sampler,
    refuse_for_streaming,
)
from ddpkit.data.device import resolve_loader_device
from ddpkit.data.epochs import EpochCursor
from ddpkit.data.hand_out import hand_out, hand_out_stream
from ddpkit.data.loader_samplers import KeyBatchSampler, LoaderSampler
from ddpkit.data.map_style import map_style_source
from ddpkit.data.node_shards import NodeBatchSampler, NodeShards
from ddpkit.data.position import LoaderPosition, StepBoundary
from ddpkit.data.sample_seeds import SeededDataset, _mix
from ddpkit.data.sampler import GlobalBatchSampler
from ddpkit.data.streaming import Stream, StreamShard, passed_on
from ddpkit.data.workers import WorkerInit, settle_stopped_queues, track_workers
from ddpkit.distributed import worker_device
from ddpkit.errors import UserError
from ddpkit.log import get_logger

__all__ = ["ArrowBatchDataset", "BatchReadDataset", "DataLoader", "SeededDataset"]


class DataLoader(torch.utils.data.DataLoader[Any]):
    """A ``torch.utils.data.DataLoader`` of this rank's share of each global batch, with torch's arguments.

    Every argument of torch's DataLoader has torch's meaning (the manual's Data
    page has the table); ddpkit's additions are keyword-only.

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
        num_workers: as torch's DataLoader; so are ``collate_fn``,
            ``timeout``, ``worker_init_fn``, ``multiprocessing_context``,
            ``prefetch_factor``, ``persistent_workers``, ``pin_memory_device``
            and ``in_order``.
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

    Epochs and the position: the loader is at (``epoch``, ``step_in_epoch``);
    the rules that move it (``set_epoch``, a new pass, a look at
    ``next(iter(loader))``, a loop that leaves an epoch early) are
    in :mod:`ddpkit.data.epochs`. With a Checkpointer, rank 0 warns once when a
    loop leaves an epoch early: a run resumed inside such an epoch is handed
    the epoch's remaining batches.

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
        if isinstance(dataset, NodeShards):  # each node's ranks split that node's samples only
            rank, world_size = dataset.local_rank, dataset.local_world_size
        rank, world_size = rank_and_world(rank, world_size)
        global_batch_size = global_batch(batch_size, global_batch_size, world_size, rank)
        seed = loader_seed(seed, generator)
        torch_arguments = dict(
            num_workers=num_workers,
            pin_memory=pin_memory,
            timeout=timeout,
            worker_init_fn=WorkerInit(worker_init_fn),
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
            source = map_style_source(
                dataset,
                global_batch_size,
                rank,
                world_size,
                drop_last,
                collate_fn,
                num_workers,
                shuffle=shuffle,
                sampler=sampler,
                seed=seed,
                seed_per_sample=seed_per_sample,
            )
            self._sampler, self._tensor_fast_path = source.sampler, source.tensor_fast_path
            torch_arguments["pin_memory"] = pin_memory and not source.tensor_fast_path
            super().__init__(
                source.dataset,
                batch_sampler=KeyBatchSampler(source.sampler),
                collate_fn=Collate(collate_fn or default_collate),
                **torch_arguments,
            )
        # torch's attributes, read by tools that inspect loaders; torch forbids setting them once built.
        object.__setattr__(self, "sampler", LoaderSampler(self, sampler))
        object.__setattr__(self, "batch_size", global_batch_size // world_size)
        object.__setattr__(self, "drop_last", drop_last)
        self._rank, self._world_size, self._global_batch_size = rank, world_size, global_batch_size
        self._seed = seed
        self._global_count: int | None = None
        # The position (see "Epochs and the position" in the class docstring).
        self._cursor = EpochCursor()
        self._left_early_said = False
        self._order_agreed = False  # checked across ranks at the first iteration (ddpkit.data.agreement)
        self.step_boundary = StepBoundary()
        """Hooks run each time the loop asks for the next batch, and once when the epoch's batches run out:
        the points where the loop's body is complete (a Checkpointer registers its writes there)."""
        self._sample_bytes: int | None = None  # of one sample, read before the workers first start

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
        if not self._order_agreed:
            self._order_agreed = True
            agree_on_order(self._sampler, self._rank, self._world_size)
        if self._cursor.left_early():
            self._say_left_early()
        epoch, start = self._cursor.begin_pass()
        if self._tensor_fast_path:
            dataset = self.dataset
            assert isinstance(dataset, TensorDataset), "the fast path is a TensorDataset's"
            return self._hand_out(tensor_batches(dataset, self._global_sampler, epoch, start))
        if self._stream is not None:
            self._stream.shard.set_epoch(epoch)
        else:
            key_sampler = self.batch_sampler
            assert isinstance(key_sampler, KeyBatchSampler), "a map-style loader's"
            key_sampler.epoch, key_sampler.start = epoch, start
        # Workers' seeds a function of (seed, epoch), so a resumed epoch gets the same ones.
        self.generator.manual_seed(_mix(_mix(self._seed) + epoch))
        if self.num_workers and self._sample_bytes is None and self._stream is None:
            self._check_shared_memory(epoch)  # (a stream's samples cannot be read ahead of its workers)
        if self.num_workers:
            settle_stopped_queues()  # no fork while a stopped iterator's threads end (see the function)
        batches = super().__iter__()
        track_workers(batches)
        if self._stream is not None:
            cursor, boundary, device = self._cursor, self.step_boundary, self._device
            return self._counted(hand_out_stream(batches, self._stream, epoch, start, cursor, boundary, device))
        return self._hand_out(batches)

    def _say_left_early(self) -> None:
        """Rank 0, once, with a Checkpointer: a run resumed inside an epoch the loop leaves early differs."""
        if self._left_early_said or not self.step_boundary.hooks or self._rank != 0:
            return
        self._left_early_said = True
        known = self._stream is None or self._stream.known_steps is not None
        get_logger().warning(self._cursor.left_early_message(self.steps_per_epoch if known else None))

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
        sampler, device, boundary = self._global_sampler, self._device, self.step_boundary
        pin, translate = self._tensor_fast_path, self._shared_memory_error
        return self._counted(hand_out(iter(batches), sampler, self._cursor, boundary, device, pin, translate))

    def _counted(self, handed: Iterator[tuple[Any, int]]) -> Iterator[Any]:
        """The batches of ``handed`` (:mod:`ddpkit.data.hand_out`), keeping each one's global batch length."""
        for batch, self._global_count in handed:
            yield batch

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
        if isinstance(self._sampler, NodeBatchSampler):  # the step's samples are spread over every node
            return loss_sum * self._sampler.job_mean_scale(self._cursor.step_in_epoch - 1)
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
        cursor = self._cursor
        if cursor.mismatch(epoch):
            raise UserError(cursor.mismatch_message(epoch, self.steps_per_epoch))
        if epoch != cursor.epoch and cursor.left_early():
            self._say_left_early()
        if cursor.set_epoch(epoch):
            if self._stream is not None:
                self._stream.shard.start = {}

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
        cursor = self._cursor
        state.update(epoch=cursor.epoch, step_in_epoch=cursor.step_in_epoch, epoch_done=cursor.epoch_done)
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
        self._cursor.restore(epoch, step)
        self._global_count = None

    def position(self) -> LoaderPosition:
        """Where the loader stands: the epoch, the batches handed out, whether the loop ran out of them."""
        return self._cursor.position(self.steps_per_epoch, self._stream is not None)

    def _rank_indices(self) -> Iterator[int]:
        """This rank's indices of the current epoch, from its start step on (``loader.sampler``'s iteration)."""
        for share in self._global_sampler.shares(self._cursor.epoch, self._cursor.start_step):
            yield from share

    def _rank_length(self) -> int:
        """This rank's samples in an epoch (``len(loader.sampler)``)."""
        sampler = self._global_sampler
        return sum(stop - start for start, stop in map(sampler._share, range(sampler.steps_per_epoch)))

    @property
    def epoch(self) -> int:
        """The epoch being (or next to be) iterated, as numbered by ``set_epoch`` (counted from 0 without it)."""
        return self._cursor.epoch

    @property
    def step_in_epoch(self) -> int:
        """Batches of ``epoch`` handed out so far (counting those skipped by a resume)."""
        return self._cursor.step_in_epoch

    @property
    def epoch_done(self) -> bool:
        """True once the loop has run out of the current epoch's batches."""
        return self._cursor.epoch_done

    @property
    def steps_per_epoch(self) -> int:
        """Global batches per epoch, the last one possibly partial.

        For a stream, known once the epoch's last batch has been handed out;
        before that, ``step_in_epoch + 1`` (a batch is read ahead, so at least
        one more follows).
        """
        if self._stream is not None:
            return self._stream.steps_per_epoch(self._cursor.step_in_epoch)
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
