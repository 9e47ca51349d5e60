"""The lifecycle of a ddpkit.DataLoader's worker processes: they ignore stop signals, die with their
training process, and are stopped the orderly way when it exits.

torch's multiprocessing loader starts the workers; ddpkit adds three things
around them, each explained where it is done:

- :class:`WorkerInit`: a worker ignores the preemption signals (the training
  process must live to write its checkpoint) and is killed by the kernel when
  its training process dies (``PR_SET_PDEATHSIG``);
- :func:`track_workers`: the workers of every iterator are stopped at exit,
  before multiprocessing closes their queues;
- :func:`settle_stopped_queues`: before a loader forks new workers, the queue
  threads of the iterators that stopped have ended;
- :func:`kill_workers`: a loader that cannot go on (a full /dev/shm) ends its
  workers at once.
"""

from __future__ import annotations

import multiprocessing.util
import os
import sys
import weakref
from collections.abc import Callable
from typing import Any

import torch

from ddpkit.ending_threads import join_ending_threads
from ddpkit.names import DEFAULT_PREEMPT_SIGNALS

__all__ = ["WorkerInit", "kill_workers", "settle_stopped_queues", "track_workers"]


def kill_workers(iterator: Any) -> None:
    """SIGKILL the worker processes of torch's multiprocessing loader ``iterator`` (none: nothing to do).

    Their pids leave torch's SIGCHLD watch first, which would otherwise raise
    "DataLoader worker is killed" wherever the training process happens to be.
    """
    if getattr(iterator, "_worker_pids_set", False):
        torch._C._remove_worker_pids(id(iterator))  # what torch's signal_handling imports it as
        iterator._worker_pids_set = False
    for worker in getattr(iterator, "_workers", ()):
        worker.kill()


_LIVE_WORKER_ITERATORS: weakref.WeakSet[Any] = weakref.WeakSet()
"""Iterators of ddpkit loaders that have worker processes (persistent ones live as long as their loader)."""
_WORKER_PROCESSES: weakref.WeakSet[Any] = weakref.WeakSet()
"""The worker processes of ddpkit loaders (multiprocessing holds each until it is joined)."""


def _shut_down_workers_at_exit() -> None:
    """Have this process stop its loaders' workers the orderly way when it exits (once per process).

    The workers ignore SIGTERM (see ``WorkerInit``), and multiprocessing's
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
    # A worker that did not stop when asked (torch's fallback, SIGTERM, is ignored: see WorkerInit) would
    # keep this process waiting at exit for ever: one stuck since its fork, say, after a peer ran out of
    # shared memory. As a daemonic process it is to end with its parent anyway.
    for worker in list(_WORKER_PROCESSES):
        if worker.is_alive():
            worker.kill()
            worker.join()


_EXIT_HANDLER_PID = 0


class WorkerInit:
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


def track_workers(iterator: Any) -> None:
    """Stop the workers of torch's loader ``iterator`` (if it has any) when this process exits; settle its
    queues' threads before the next workers are forked (:func:`settle_stopped_queues`)."""
    if hasattr(iterator, "_shutdown_workers") and iterator not in _LIVE_WORKER_ITERATORS:  # (persistent: once)
        _LIVE_WORKER_ITERATORS.add(iterator)
        _WORKER_PROCESSES.update(getattr(iterator, "_workers", ()))
        _shut_down_workers_at_exit()
        # An iterator dropped unfinished (a loop that breaks) is shut down when it is collected: its queues
        # then join the stopped ones.
        weakref.finalize(iterator, _STOPPED_QUEUES.extend, _queues(iterator))


_STOPPED_QUEUES: list[Any] = []
"""The queues of collected iterators whose feeder threads may still be ending."""


def _queues(iterator: Any) -> list[Any]:
    """The multiprocessing queues torch's loader ``iterator`` put messages into (each has a feeder thread)."""
    return [*getattr(iterator, "_index_queues", ()), getattr(iterator, "_worker_result_queue", None)]


def settle_stopped_queues() -> None:
    """Wait (at most 1 s) for the feeder threads of stopped iterators' queues, and ddpkit's other threads that
    are ending, to end; call it before forking workers (:mod:`ddpkit.ending_threads` says why).

    A stopped iterator closes its queues, and each queue's feeder thread then ends on its own: a loader's
    new workers, forked for the next epoch as the previous iterator's threads end, would hang for ever.
    """
    queues, _STOPPED_QUEUES[:] = list(_STOPPED_QUEUES), []
    for iterator in list(_LIVE_WORKER_ITERATORS):
        if getattr(iterator, "_shutdown", False):
            _LIVE_WORKER_ITERATORS.discard(iterator)
            queues.extend(_queues(iterator))
    # multiprocessing's feeder thread of each queue, started by its first put
    feeders = [thread for thread in (getattr(queue, "_thread", None) for queue in queues) if thread is not None]
    join_ending_threads(feeders)
