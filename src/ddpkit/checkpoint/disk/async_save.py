"""Asynchronous saves: the state is copied off the training path, then written by a background thread.

``Checkpointer(..., async_save=True)`` splits a save in two::

    training thread   step ... step | copy state (pinned CPU) | step  step  step ...
    background thread               |                          | torch.save, SHA-256, fsync, rename, manifest

:func:`copy_state` makes the copy: every tensor's storage once (tensors that
share a storage share the copy, views keep their offset and strides), into
pinned CPU memory for CUDA tensors, so that ``torch.save`` of the copy writes
the same bytes as ``torch.save`` of the original would, and the training
loop may change the original the moment the copy is made. The
:class:`BackgroundWriter` then runs the same atomic, verified write as a
synchronous save (:mod:`ddpkit.checkpoint.disk.format`): a process killed
mid-write leaves a folder without a manifest, and the previous checkpoint is
the newest complete one.

The writer runs tasks one after another on threads that are not daemons, at
the process's own priority, and waits for them when the interpreter exits
(``atexit``), so a script that ends without ``close()`` still completes its
last checkpoint. Writing costs CPU (serialising, SHA-256, the kernel's copy
into the page cache): where training keeps every core busy, a writer at the
lowest priority (niceness 19) only ran once the loop waited for it at the next
save, and the loop lost more than at equal priority, where the write shares
the cores as it goes (T10 on a 2-core VM, alternated in one run: 0.74-1.03 of
a synchronous save at niceness 19, 0.42-0.66 at equal priority).
"""

from __future__ import annotations

import atexit
import copy
import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch

from ddpkit.ending_threads import about_to_end

__all__ = ["BackgroundWriter", "copy_state"]

_ATOMIC = (int, float, bool, str, bytes, type(None), torch.dtype, torch.device)


def copy_state(state: Any, *, copy_cpu: bool, pin_memory: bool, buffers: list[Any] | None = None) -> Any:
    """``state`` with its tensors copied to CPU memory, storage sharing and containers' types kept.

    Args:
        state: a state_dict-like structure of dicts, lists, tuples, tensors and plain values.
        copy_cpu: also copy CPU tensors (and containers), so that later changes
            to the originals do not reach the copy; False moves CUDA tensors
            only (what ``torch.save`` would do itself).
        pin_memory: copy CUDA tensors into pinned memory (a faster transfer).
        buffers: storages of an earlier copy of a state of the same shapes, reused (and
            extended) in the order met: a fresh allocation costs a page fault per 4 KiB page,
            a reused one only the copy. Its earlier copy must no longer be read.

    Returns:
        The copy; CUDA copies are complete when it returns.
    """
    copier = _Copier(copy_cpu, pin_memory, [] if buffers is None else buffers)
    result = copier.copy(state)
    if copier.from_cuda:
        torch.cuda.synchronize()  # the non-blocking device-to-host copies are done before anyone reads them
    return result


class _Copier:
    """One walk over a state: storages already copied, by the identity of their storage."""

    def __init__(self, copy_cpu: bool, pin_memory: bool, buffers: list[Any]):
        self.copy_cpu, self.pin_memory, self.buffers = copy_cpu, pin_memory, buffers
        self.storages: dict[int, Any] = {}
        self.memo: dict[int, Any] = {}
        self.from_cuda = False

    def copy(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return self.tensor(value)
        if isinstance(value, _ATOMIC):
            return value
        if isinstance(value, dict):
            if not self.copy_cpu and not self._holds_cuda(value):
                return value
            new = copy.copy(value)  # keeps the type and attributes (a state_dict's _metadata)
            for key, item in value.items():
                new[key] = self.copy(item)
            return new
        if isinstance(value, (list, tuple)):
            if not self.copy_cpu and not self._holds_cuda(value):
                return value
            items = [self.copy(item) for item in value]
            if isinstance(value, tuple) and hasattr(value, "_fields"):  # namedtuple
                return type(value)(*items)
            return type(value)(items)
        return copy.deepcopy(value, self.memo) if self.copy_cpu else value

    def _holds_cuda(self, value: Any) -> bool:
        items = value.values() if isinstance(value, dict) else value
        return any(
            (isinstance(item, torch.Tensor) and item.device.type != "cpu")
            or (isinstance(item, (dict, list, tuple)) and self._holds_cuda(item))
            for item in items
        )

    def _buffer(self, nbytes: int, pin: bool) -> Any:
        """The next storage of ``nbytes``: the earlier copy's at this place when it fits, else a new one."""
        index = len(self.storages)
        if index < len(self.buffers):
            buffer = self.buffers[index]
            if buffer.nbytes() == nbytes and buffer.is_pinned() == pin:
                return buffer
        buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin).untyped_storage()
        if index < len(self.buffers):
            self.buffers[index] = buffer
        else:
            self.buffers.append(buffer)
        return buffer

    def tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        on_cpu = tensor.device.type == "cpu"
        if on_cpu and not self.copy_cpu:
            return tensor
        if type(tensor) is not torch.Tensor or tensor.layout != torch.strided or tensor.is_quantized:
            # A Parameter, sparse or quantized tensor: torch's own copy (deepcopy keeps sharing through the memo).
            return copy.deepcopy(tensor, self.memo) if on_cpu else tensor.detach().cpu()
        storage = tensor.untyped_storage()
        copied = self.storages.get(storage._cdata)
        if copied is None:
            pin = self.pin_memory and not on_cpu
            copied = self._buffer(storage.nbytes(), pin)
            copied.copy_(storage, non_blocking=pin)
            self.from_cuda = self.from_cuda or not on_cpu
            self.storages[storage._cdata] = copied
        result = torch.empty(0, dtype=tensor.dtype).set_(
            copied, tensor.storage_offset(), tensor.size(), tensor.stride()
        )
        return result.requires_grad_() if tensor.requires_grad else result


class BackgroundWriter:
    """Runs tasks in order on a background thread; results and errors come back at ``collect()``.

    ``submit`` never waits: a task submitted while another runs starts when
    that one ends. Each task's ``on_done`` is called on the caller's thread,
    by ``collect()``, in order; a task's exception is raised there.
    """

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._finished: list[tuple[Callable[[Any], None] | None, Any, BaseException | None]] = []
        self._lock = threading.Lock()
        _WRITERS.add(self)

    @property
    def busy(self) -> bool:
        """True while a task runs or waits to run."""
        return self._thread is not None and self._thread.is_alive()

    def submit(self, task: Callable[[], Any], on_done: Callable[[Any], None] | None = None) -> None:
        """Run ``task()`` after the tasks submitted before it; ``on_done(result)`` at the next ``collect``."""
        previous = self._thread

        def run() -> None:
            if previous is not None:
                previous.join()
            result, error = None, None
            try:
                result = task()
            except BaseException as e:  # raised on the caller's thread by collect()
                error = e
            with self._lock:
                self._finished.append((on_done, result, error))
            about_to_end()  # a loader forking its workers now waits for this thread's end first

        self._thread = threading.Thread(target=run, name="ddpkit-checkpoint-writer", daemon=False)
        self._thread.start()

    def collect(self, wait: bool = True) -> None:
        """Hand back what finished: ``on_done`` of each task in order; raise the first task's error.

        Args:
            wait: first wait for every submitted task to finish.
        """
        if wait and self._thread is not None:
            self._thread.join()
        with self._lock:
            finished, self._finished = self._finished, []
        error = next((e for _, _, e in finished if e is not None), None)
        for on_done, result, e in finished:
            if e is None and on_done is not None:
                on_done(result)
        if error is not None:
            raise error

    def join(self) -> None:
        """Wait for every submitted task, without handing anything back (at exit)."""
        if self._thread is not None:
            self._thread.join()


_WRITERS: weakref.WeakSet[BackgroundWriter] = weakref.WeakSet()


@atexit.register
def _finish_writes_at_exit() -> None:
    # ddpkit's commands leave with os._exit once atexit handlers ran: a write still running would be cut.
    for writer in list(_WRITERS):
        writer.join()
