"""Threads about to end, which a fork must wait for.

CPython 3.11 deadlocks a child process forked while a thread of the parent
is ending: the ending thread holds the interpreter's thread-list lock for a
moment, the child inherits the lock held by a thread it does not have, and
waits for it for ever in ``PyOS_AfterFork_Child``. A DataLoader forks its
workers at the start of every epoch (unless they persist), while ddpkit's
own short-lived threads (a background checkpoint write) may be ending.

A thread that is done calls :func:`about_to_end` as its last act; the code
that forks calls :func:`join_ending_threads` first. Once ``join`` returns,
the thread's teardown is complete (it holds the GIL until then), so the fork
is safe from it.
"""

from __future__ import annotations

import threading
import time

__all__ = ["about_to_end", "join_ending_threads"]

_ENDING: set[threading.Thread] = set()
_LOCK = threading.Lock()


def about_to_end() -> None:
    """Say that the calling thread returns now (its last call)."""
    with _LOCK:
        _ENDING.add(threading.current_thread())


def join_ending_threads(threads: list[threading.Thread] | None = None, timeout: float = 1.0) -> None:
    """Wait, at most ``timeout`` seconds in all, for the threads that said they end, and ``threads``.

    Args:
        threads: more threads known to be ending (the feeders of closed queues).
        timeout: the whole wait's limit: a thread that does not end in time (blocked writing to a pipe
            nobody reads) is left, and the fork takes its chance, as it would without this.
    """
    with _LOCK:
        ending = [*_ENDING, *(threads or [])]
        _ENDING.clear()
    deadline = time.monotonic() + timeout
    current = threading.current_thread()
    for thread in ending:
        if thread is not current:
            thread.join(max(0.0, deadline - time.monotonic()))
