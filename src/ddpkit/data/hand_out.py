"""Handing a ``ddpkit.DataLoader``'s batches to the loop, one step at a time.

Each time the loop asks for the next batch, the step-boundary hooks run first
(:class:`~ddpkit.data.position.StepBoundary`: the loop's body for the previous
batch is complete, so a Checkpointer writes there). A batch is counted in the
loader's position (:class:`~ddpkit.data.epochs.EpochCursor`) as the loop
receives it, not when a worker made it: workers prefetch, and run the sampler
ahead. When the batches run out the hooks run once more and the epoch is done.

Both generators yield ``(batch, n)``: n the samples, over all ranks, of the
global batch the batch belongs to (what ``DataLoader.global_mean`` divides by).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

from ddpkit.data.device import on_device
from ddpkit.data.epochs import EpochCursor
from ddpkit.data.position import StepBoundary
from ddpkit.data.sampler import GlobalBatchSampler
from ddpkit.data.streaming import Stream
from ddpkit.data.workers import kill_workers

__all__ = ["hand_out", "hand_out_stream"]


def hand_out(
    batches: Iterator[Any],
    sampler: GlobalBatchSampler,
    cursor: EpochCursor,
    boundary: StepBoundary,
    device: torch.device | None,
    pin: bool,
    translate: Callable[[RuntimeError], Exception],
) -> Iterator[tuple[Any, int]]:
    """A map-style loader's batches from torch's iterator ``batches``, placed on ``device``.

    Args:
        batches: torch's DataLoader iterator of this rank's batches.
        sampler: the global order, which knows each global batch's length.
        cursor: the loader's position, moved as each batch reaches the loop.
        boundary: the hooks run before each batch is taken, and once at the end.
        device: where batches go (None: as they are), ``pin`` first where asked.
        pin: pin each batch before the copy (the TensorDataset fast path, which torch does not pin).
        translate: torch's error of a worker, or the one line that replaces it
            (/dev/shm full); when replaced, the workers are ended first.
    """
    placed = on_device(batches, device, pin=pin)
    while True:
        if boundary.hooks:
            boundary.run()
        try:
            batch = next(placed)
        except StopIteration:
            break
        except RuntimeError as error:
            translated = translate(error)
            if translated is error:
                raise
            # Workers blocked on the full /dev/shm do not stop when asked, and ignore SIGTERM (WorkerInit):
            # torch's shutdown would wait on each in turn. This loader cannot go on: end them now.
            kill_workers(batches)
            raise translated from error
        count = sampler.global_batch_length(cursor.step_in_epoch)
        cursor.handed_out()
        yield batch, count
    cursor.ran_out()


def hand_out_stream(
    batches: Iterator[Any],
    stream: Stream,
    epoch: int,
    start: int,
    cursor: EpochCursor,
    boundary: StepBoundary,
    device: torch.device | None,
) -> Iterator[tuple[Any, int]]:
    """As :func:`hand_out`, for a stream: each worker's position is kept once its batch reaches the loop.

    Args:
        batches: torch's DataLoader iterator over the stream's shard.
        stream: the training process's side of the stream (positions, agreement across ranks).
        epoch, start: the epoch, and the step this pass starts at.
        cursor, boundary, device: as :func:`hand_out`.
    """
    stream.positions, stream.known_steps = dict(stream.shard.start), None
    agreed = on_device(stream.agreed(batches, epoch, start), device, batch_first=True)
    while True:
        if boundary.hooks:
            boundary.run()
        item = next(agreed, None)
        if item is None:
            break
        batch, worker, position, count, last = item
        stream.positions[worker] = position
        cursor.handed_out()
        if last:
            stream.known_steps = cursor.step_in_epoch
        yield batch, count
    stream.known_steps = cursor.step_in_epoch
    stream.shard.start = {}
    cursor.ran_out()
