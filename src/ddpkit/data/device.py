"""Batches on the worker's device: the traversal that moves them, and the copy of the next one overlapped.

``ddpkit.DataLoader`` hands out batches on the worker's CUDA device (its
``device`` keyword, "auto" by default; ``device=None`` keeps them where the
dataset made them). Two parts, each usable alone:

- :func:`move_to_device`, a pure function: the tensors inside tuples, lists,
  dicts (and other Mappings), namedtuples and dataclasses, nested in any way,
  moved with ``tensor.to(device, non_blocking=...)`` (a PackedSequence's
  ``batch_sizes`` stay on the CPU, as its own ``to`` keeps them); anything
  else (strings, numbers, None, numpy arrays, objects of other classes) is
  kept as it is. A
  batch whose tensors are already there is returned itself, so a script's own
  ``x.to(device)`` after the loader costs nothing.
- :class:`DevicePrefetcher`, an iterator over a source of CPU batches that
  copies the *next* batch on a CUDA stream of its own while the loop trains
  on the current one (the technique of NVIDIA's apex and timm's
  ``PrefetchLoader``)::

      source:   b0 ─────── b1 ─────── b2 ───────
      copy:     [h2d b0] [h2d b1]   [h2d b2]              (side stream)
      compute:           [step b0 ][step b1  ][step b2 ]  (the loop's stream)
                         ^ waits for b0's copy event

  When the loop takes batch n, batch n+1 is taken from the source and its
  copy issued on the side stream before batch n is handed out, so the copy
  runs while step n's kernels do. The bookkeeping that makes it safe:

  * the loop's stream waits for an event recorded after batch n's copy
    before anything it queues touches batch n (``wait_event``);
  * every CUDA tensor of batch n is marked as used by the loop's stream
    (``record_stream``): its memory was allocated on the side stream, and
    without the mark the caching allocator could hand it to the copy of a
    later batch as soon as the loop drops it, while the loop's kernels still
    read it;
  * the source (CPU) batch is kept until the batch after it is handed out:
    a non-blocking copy reads its pinned memory after ``to()`` returns (torch's
    pinned-memory allocator also records the copy's event before reusing a
    freed block; holding it is the cheap belt to those braces).

  Non-blocking copies overlap only from pinned memory: the loader pins its
  batches (``pin_memory``) when it places them on CUDA, and the prefetcher
  pins a batch that is not pinned yet when asked to (the TensorDataset fast
  path, which has no pinning thread).

The prefetcher sits below the loader's position count: the loader counts a
batch when the loop receives it, not when its copy starts, so a checkpoint
taken during step n holds position n whatever was read ahead.
"""

from __future__ import annotations

import copy
import dataclasses
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch.nn.utils.rnn import PackedSequence

__all__ = ["DevicePrefetcher", "move_to_device", "on_device", "resolve_loader_device", "tensors_in"]

DEVICE_CHOICES = "'auto', None, 'cpu', 'cuda', 'cuda:N' or a torch.device"


def move_to_device(batch: Any, device: torch.device | str, non_blocking: bool = False) -> Any:
    """``batch`` with every tensor inside it on ``device``; its structure and every other value kept.

    Containers walked: tuples, lists, Mappings (dict, OrderedDict, defaultdict,
    a Mapping of the dataset's own when it can be built from a dict, else a
    dict), namedtuples and dataclass instances, nested in any way. A container
    whose values are all unchanged is returned itself (no copy), as
    ``tensor.to(device)`` returns the tensor itself when it is there already.

    Args:
        batch: what a DataLoader handed out.
        device: where the tensors go.
        non_blocking: passed to ``tensor.to``; overlaps the copy with other
            work when the source is in pinned memory.

    Returns:
        The batch on ``device``.
    """
    return _map_tensors(batch, lambda tensor: tensor.to(device, non_blocking=non_blocking))


def tensors_in(batch: Any) -> list[torch.Tensor]:
    """The tensors inside ``batch``, in the containers :func:`move_to_device` walks."""
    found: list[torch.Tensor] = []

    def collect(tensor: torch.Tensor) -> torch.Tensor:
        found.append(tensor)
        return tensor

    _map_tensors(batch, collect)
    return found


def _map_tensors(value: Any, function: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(value, torch.Tensor):
        return function(value)
    if isinstance(value, (str, bytes)) or value is None:
        return value
    if isinstance(value, Mapping):
        items = {key: _map_tensors(item, function) for key, item in value.items()}
        if all(items[key] is item for key, item in value.items()):
            return value
        if isinstance(value, defaultdict):
            return type(value)(value.default_factory, items)
        mapping_type: Any = type(value)
        try:
            return mapping_type(items)
        except TypeError:  # a Mapping that cannot be built from a dict: a dict, as default_collate falls back
            return items
    if isinstance(value, PackedSequence):
        # A namedtuple whose batch_sizes must stay on the CPU (what PackedSequence.to does too).
        data, sorted_indices, unsorted_indices = (
            _map_tensors(part, function) for part in (value.data, value.sorted_indices, value.unsorted_indices)
        )
        if data is value.data and sorted_indices is value.sorted_indices:
            return value
        return PackedSequence(data, value.batch_sizes, sorted_indices, unsorted_indices)
    if isinstance(value, (list, tuple)):
        values = [_map_tensors(item, function) for item in value]
        if all(new is old for new, old in zip(values, value)):
            return value
        if isinstance(value, tuple) and hasattr(value, "_fields"):  # namedtuple
            return type(value)(*values)
        return type(value)(values)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = [field.name for field in dataclasses.fields(value)]
        moved = {name: _map_tensors(getattr(value, name), function) for name in fields}
        if all(moved[name] is getattr(value, name) for name in fields):
            return value
        # A shallow copy with its fields replaced: works for frozen dataclasses and fields with init=False.
        result = copy.copy(value)
        for name, item in moved.items():
            object.__setattr__(result, name, item)
        return result
    return value


def resolve_loader_device(
    requested: torch.device | str | None, worker_device: torch.device | None, cuda_available: Callable[[], bool]
) -> torch.device | None:
    """The device a loader places its batches on, or None to hand them out as the dataset made them.

    Args:
        requested: the loader's ``device``: "auto" (the worker's CUDA device
            where ddpkit.init, or an nccl process group, chose one; else None),
            None or "cpu" (batches stay on the CPU), "cuda" (the current CUDA
            device), "cuda:N", or a torch.device.
        worker_device: the device ddpkit.init chose for this worker (None
            before ddpkit.init and without an nccl group).
        cuda_available: ``torch.cuda.is_available``, asked only where a CUDA
            device is in question (a CPU loader asks nothing of CUDA).

    Raises:
        UserError: an unknown value, or a CUDA device where CUDA is missing.
    """
    from ddpkit.errors import UserError

    if requested is None:
        return None
    if isinstance(requested, str) and requested == "auto":
        if worker_device is not None and worker_device.type == "cuda" and cuda_available():
            return worker_device
        return None
    try:
        device = torch.device(requested)
    except (RuntimeError, TypeError) as e:
        raise UserError(f"DataLoader(device={requested!r}) is not valid; use {DEVICE_CHOICES}") from e
    if device.type == "cpu":
        return None
    if device.type != "cuda":
        raise UserError(
            f"DataLoader(device={requested!r}): only CUDA devices are placed; use {DEVICE_CHOICES} "
            "(or move the batches in the loop)"
        )
    if not cuda_available():
        raise UserError(
            f"DataLoader(device={requested!r}) but CUDA is not available here; use device='auto' or device=None"
        )
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def on_device(
    batches: Iterator[Any], device: torch.device | None, pin: bool = False, batch_first: bool = False
) -> Iterator[Any]:
    """``batches`` themselves where ``device`` is None (nothing added per batch), else a :class:`DevicePrefetcher`."""
    return batches if device is None else DevicePrefetcher(batches, device, pin, batch_first)


class DevicePrefetcher:
    """Iterates ``batches`` moved to the CUDA ``device``, the next batch's copy overlapped with the current step.

    See the module docstring for the stream bookkeeping. ``pin`` pins a CPU
    batch first where it is not pinned (a non-blocking copy from pageable
    memory does not overlap).

    Args:
        batches: the source, batches on the CPU (or already on ``device``).
        device: a CUDA device.
        pin: pin batches that are not in pinned memory.
        batch_first: the source's items are tuples whose first element is
            the batch, the others bookkeeping to leave where it is (the
            loader's stream: ``(batch, worker, position, ...)``, a position
            that may hold a dataset's state tensors).
    """

    def __init__(self, batches: Iterator[Any], device: torch.device, pin: bool = False, batch_first: bool = False):
        assert device.type == "cuda", "the prefetcher copies to a CUDA device"
        self._batches = batches
        self._device = device
        self._pin = pin
        self._batch_first = batch_first
        self._stream = torch.cuda.Stream(device)
        self._next: tuple[Any, torch.cuda.Event, Any, Any] | None = None  # moved, its copy's event, source, item
        self._held: Any = None  # the source of the batch handed out last
        self._started = False

    def __iter__(self) -> DevicePrefetcher:
        return self

    def _issue(self) -> None:
        """Take the next source batch and queue its copy on the side stream (None at the source's end)."""
        try:
            item = next(self._batches)
        except StopIteration:
            self._next = None
            return
        source = item[0] if self._batch_first else item
        if self._pin:
            source = _pinned(source)
        with torch.cuda.stream(self._stream):
            moved = move_to_device(source, self._device, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(self._stream)
        self._next = (moved, copied, source, item)

    def __next__(self) -> Any:
        if not self._started:
            self._started = True
            self._issue()
        if self._next is None:
            raise StopIteration
        moved, copied, source, item = self._next
        compute = torch.cuda.current_stream(self._device)
        compute.wait_event(copied)  # what the loop queues from now on runs after the copy
        for tensor in tensors_in(moved):
            if tensor.device.type == "cuda":
                tensor.record_stream(compute)  # its memory is not reused before the loop's kernels are done with it
        self._held = source  # until the next batch is handed out (see the module docstring)
        self._issue()  # the next batch's copy, queued before the loop queues this batch's step
        return (moved, *item[1:]) if self._batch_first else moved


def _pinned(batch: Any) -> Any:
    """``batch`` with its CPU tensors in pinned memory (those pinned already kept)."""
    return _map_tensors(
        batch, lambda tensor: tensor.pin_memory() if tensor.device.type == "cpu" and not tensor.is_pinned() else tensor
    )
