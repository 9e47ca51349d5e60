"""Streaming: an ``IterableDataset`` through ``ddpkit.DataLoader``, sharded, resumable, ending together.

Sharding is explicit, so that every sample of an epoch is read by exactly
one rank and one loader worker:

- a Hugging Face ``datasets.IterableDataset`` is split with its own
  ``split_dataset_by_node(dataset, rank, world_size)`` (whole shards per
  rank when ``num_shards`` is a multiple of the world size, else one example
  in ``world_size``), and shares its shards among the loader workers itself;
- any other stream is dealt round-robin: with W ranks of N workers, worker
  w of rank r keeps samples r*N+w, r*N+w + W*N, ... of the stream. Every
  worker reads the whole stream, so a dataset that splits itself among
  workers (``get_worker_info``) must yield the whole stream here.

Each worker batches its own samples (``batch_size`` per rank, torch's
``drop_last`` per worker, as torch's loader batches a stream) and sends each
batch with its position after it: the dataset's ``state_dict()`` where it
has one (HF ``datasets.IterableDataset``, torchdata's Stateful protocol) and
the count of samples it read. The training process keeps the position of the
last batch it handed to the loop, per worker::

    worker 0: batch, pos0 ->  \\
    worker 1: batch, pos1 ->  -> loop         positions: {0: pos0, 1: pos1}
                                              state_dict(): every rank's positions

Uneven ends: ranks whose streams differ in length would hang the collectives
of backward at the end of an epoch. The epoch ends for every rank at the
shortest: before each batch the ranks all_reduce "I have a batch" (and its
rows, for ``global_mean``), and when one rank has none, all stop there. The
samples the longer ranks still had are not trained that epoch; rank 0 says so
in one line. (An HF dataset with ``num_shards`` a multiple of ``world_size *
num_workers`` and equal shards ends evenly.)

Resume: at the same world size and number of workers, each worker reloads its
position and the epoch continues where the loop stopped. At another one, the
positions do not map onto the new shards: the epoch starts over with the new
sharding, which loses no sample (those trained before the stop are trained
again, in another order), and rank 0 says so. A dataset without
``state_dict``/``load_state_dict`` can resume at an epoch's start only; mid
epoch it is refused with one line.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Protocol, cast

import torch
import torch.distributed as dist
from torch.utils.data import IterableDataset, get_worker_info

from ddpkit.errors import UserError
from ddpkit.log import get_logger

__all__ = ["StreamShard", "Stream"]


def _hf_iterable(dataset: Any) -> bool:
    """True for a Hugging Face ``datasets.IterableDataset`` (without importing ``datasets``)."""
    module = sys.modules.get("datasets")
    return module is not None and isinstance(dataset, module.IterableDataset)


class EpochStream(Protocol):
    """A stream whose order depends on the epoch it is told (HF IterableDataset, a user's with ``set_epoch``)."""

    def set_epoch(self, epoch: int) -> None:
        """Read ``epoch``'s order next."""


class StatefulStream(Protocol):
    """A stream that reports and restores its position (:func:`is_stateful`)."""

    def state_dict(self) -> dict[str, Any]:
        """The position, to pass to ``load_state_dict``."""

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a position ``state_dict`` reported."""


def is_stateful(dataset: Any) -> bool:
    """The dataset can report and restore its position (HF IterableDataset, torchdata's Stateful)."""
    return callable(getattr(dataset, "state_dict", None)) and callable(getattr(dataset, "load_state_dict", None))


def batch_rows(batch: Any) -> int:
    """Samples in a collated batch: the length of its first tensor (or list) found depth first."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() else 1
    if isinstance(batch, Mapping):
        values = list(batch.values())
    elif isinstance(batch, (list, tuple)):
        if not batch or not isinstance(batch[0], (torch.Tensor, Mapping, list, tuple)):
            return len(batch)
        values = list(batch)
    else:
        return 1
    return batch_rows(values[0]) if values else 0


class StreamShard(IterableDataset[tuple[Any, int, dict[str, Any]]]):
    """This rank's share of a stream, batched in each loader worker, each batch with the worker's position.

    Yields ``(batch, worker_id, position)``. The loader sets ``epoch`` and
    ``start`` (worker id -> position to continue from) before each pass; the
    workers receive them with the dataset.

    Args:
        dataset: the user's IterableDataset.
        rank, world_size: this rank, and the number of ranks.
        batch_size: samples per batch on this rank.
        drop_last: drop a worker's last incomplete batch.
        collate_fn: makes a batch of a list of samples.
    """

    def __init__(
        self,
        dataset: IterableDataset[Any],
        rank: int,
        world_size: int,
        batch_size: int,
        drop_last: bool,
        collate_fn: Callable[[list[Any]], Any],
    ):
        self.round_robin = not _hf_iterable(dataset)
        if not self.round_robin:
            from datasets.distributed import split_dataset_by_node  # type: ignore[import-untyped]  # (no type information)

            dataset = split_dataset_by_node(dataset, rank=rank, world_size=world_size)
        self.dataset, self.rank, self.world_size = dataset, rank, world_size
        self.batch_size, self.drop_last, self.collate_fn = batch_size, drop_last, collate_fn
        self.stateful = is_stateful(dataset)
        self.epoch = 0
        self.start: dict[int, dict[str, Any]] = {}

    def set_epoch(self, epoch: int) -> None:
        """The training process, before the pass's workers start: the epoch they read.

        An HF dataset's epoch is told here, once: HF keeps it in shared memory
        (for persistent workers) and its ``set_epoch`` adds the difference to
        the shared value, so two workers calling it at once for a new epoch
        added it twice, and one worker's shards then differed from the other's
        (the same shard read twice in an epoch, another not at all).
        """
        self.epoch = epoch
        if not self.round_robin:
            cast(EpochStream, self.dataset).set_epoch(epoch)

    def __iter__(self) -> Iterator[tuple[Any, int, dict[str, Any]]]:
        info = get_worker_info()
        worker, num_workers = (info.id, info.num_workers) if info is not None else (0, 1)
        dataset = self.dataset
        if self.round_robin and hasattr(dataset, "set_epoch"):  # (an HF dataset's is told by set_epoch above)
            cast(EpochStream, dataset).set_epoch(self.epoch)
        position, count = self.start.get(worker), 0
        if position is not None:
            count = position["count"]
            if self.stateful:
                cast(StatefulStream, dataset).load_state_dict(position["dataset"])
        stride, mine = self.world_size * num_workers, self.rank * num_workers + worker
        batch: list[Any] = []
        for sample in dataset:
            count += 1
            if self.round_robin and (count - 1) % stride != mine:
                continue
            batch.append(sample)
            if len(batch) == self.batch_size:
                yield self._sent(batch, worker, count)
                batch = []
        if batch and not self.drop_last:
            yield self._sent(batch, worker, count)

    def _sent(self, batch: list[Any], worker: int, count: int) -> tuple[Any, int, dict[str, Any]]:
        position: dict[str, Any] = {"count": count}
        if self.stateful:
            position["dataset"] = cast(StatefulStream, self.dataset).state_dict()
        return self.collate_fn(batch), worker, position


def passed_on(item: Any) -> Any:
    """The collate_fn of torch's loader over a StreamShard: the workers have collated already."""
    return item


class Stream:
    """The training process's side: batches agreed on by all ranks, and the positions of those handed out.

    Args:
        shard: the StreamShard the loader iterates.
        num_workers: the loader's worker processes.
    """

    def __init__(self, shard: StreamShard, num_workers: int):
        self.shard, self.num_workers = shard, num_workers
        self.positions: dict[int, dict[str, Any]] = {}
        self.known_steps: int | None = None
        """Batches of the epoch, once its last one has been handed out."""

    @property
    def collective(self) -> bool:
        """True when the ranks agree through torch.distributed (else each rank ends at its own end)."""
        return self.shard.world_size > 1 and dist.is_available() and dist.is_initialized()

    def agreed(
        self, batches: Iterator[tuple[Any, int, dict[str, Any]]], epoch: int, step: int
    ) -> Iterator[tuple[Any, int, dict[str, Any], int, bool]]:
        """``(batch, worker, position, global rows, last)`` while every rank has a batch.

        One batch is read ahead, so that the last batch is known as such when
        it is handed out (the Checkpointer's epoch end needs that).
        """
        current, rows = self._fetch(batches, epoch, step)
        while current is not None:
            step += 1
            following, following_rows = self._fetch(batches, epoch, step)
            yield (*current, rows, following is None)
            current, rows = following, following_rows

    def _fetch(self, batches: Iterator[tuple[Any, int, dict[str, Any]]], epoch: int, step: int) -> tuple[Any, int]:
        item = next(batches, None)
        rows = batch_rows(item[0]) if item is not None else 0
        world_size = self.shard.world_size
        if not self.collective:
            return item, rows * world_size
        # One all_reduce per batch: (ranks that have one, rows over all ranks).
        from ddpkit.distributed import control_device

        agreed = torch.tensor([item is not None, rows], dtype=torch.int64, device=control_device())
        dist.all_reduce(agreed)
        have, total = int(agreed[0]), int(agreed[1])
        if have == world_size:
            return item, total
        if have and self.shard.rank == 0:
            get_logger().warning(
                f"epoch {epoch}: {world_size - have} of {world_size} ranks ran out of stream data after "
                f"{step} batch(es) while the others had more; the epoch ended there for every rank, and the rest "
                "of the longer ranks' shares is not trained this epoch (give every rank as many samples: an HF "
                "dataset with num_shards a multiple of world_size x num_workers, in equal shards)"
            )
        return None, 0

    def steps_per_epoch(self, step_in_epoch: int) -> int:
        """The epoch's batches once known; before, ``step_in_epoch + 1`` (at least one more follows)."""
        return self.known_steps if self.known_steps is not None else step_in_epoch + 1

    # -- the position ---------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Every rank's worker positions (an all_gather: call it on every rank, as the Checkpointer does)."""
        ranks: list[Any] = [self.positions]
        if self.collective:
            ranks = [None] * self.shard.world_size
            dist.all_gather_object(ranks, self.positions)
        return {"world_size": self.shard.world_size, "num_workers": self.num_workers, "ranks": ranks}

    def load_state_dict(self, state: Mapping[str, Any], epoch: int, step: int) -> int:
        """Continue from ``state`` saved at ``step`` of ``epoch``; returns the step the epoch continues at.

        Raises:
            ValueError: mid-epoch, and the dataset has no state_dict/load_state_dict.
        """
        self.positions, self.known_steps = {}, None
        self.shard.start = {}
        if step == 0:
            return 0
        dataset = type(self.shard.dataset).__name__
        if not self.shard.stateful:
            raise UserError(
                f"the loader was saved mid-epoch (epoch {epoch}, step {step}) and {dataset} has no "
                "state_dict()/load_state_dict() to continue its stream from; give the dataset that protocol "
                "(an HF datasets.IterableDataset has it), or resume from a checkpoint taken at an epoch's end"
            )
        saved = (state["world_size"], state["num_workers"])
        if saved != (self.shard.world_size, self.num_workers):
            if self.shard.rank == 0:
                get_logger().warning(
                    f"the stream was saved by {saved[0]} rank(s) x {saved[1]} worker(s) and this run has "
                    f"{self.shard.world_size} x {self.num_workers}: its positions do not map onto the new shards, so "
                    f"epoch {epoch} starts over: no sample is lost, the {step} batch(es) per rank trained before "
                    "the stop are trained again, and the order differs"
                )
            return 0
        self.positions = dict(state["ranks"][self.shard.rank])
        self.shard.start = dict(self.positions)
        return step
