"""The worker server: one warm process that every worker of a launch is forked from.

A spawned worker is a fresh interpreter that imports torch again (about
1.5 s of one core each). The agent starts its workers with
multiprocessing's *forkserver* instead: one server process imports what
every worker imports (:data:`WORKER_PRELOAD`: torch, torch.distributed,
``torch._dynamo`` and the worker's own start) once, and every worker is a
fork of it, ready at once. ``torch._dynamo`` (with sympy) is there because
constructing any torch optimizer imports it: left to the workers, each of
them imports it again, and ``ddpkit run nproc=2`` of a one-step training
script took 1.42 times as long on 2 cores
(benchmarks/launch-preload-2core-2026-11-29.md). What only some workers need
(ddpkit's trainer) is imported by those workers alone. ``ddpkit run`` and ``ddpkit train`` start the server as their
first act (:func:`worker_server`), so that the server's imports run beside
the launcher's own on the other core.

Why a fork here is safe: the server only imports. It never runs a torch
operator nor asks for the thread count, so torch's intra-op (OpenMP) pool
and autograd threads do not exist when it forks (the server has one thread,
which tests/launchers/test_worker_server.py checks); it never initializes
CUDA, joins no process group and holds no store or socket of torch's. What
a worker takes from the server, and from the launcher, is
:mod:`ddpkit.launchers.worker_env`'s. The server ignores the signals the
launcher handles (a signal sent to the whole job must not kill it while its
workers run); each worker takes the default handlers back. The server is
stopped when the launch ends.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.forkserver
import multiprocessing.resource_tracker
import os
import signal
from collections.abc import Iterator
from typing import Any

from ddpkit.launchers.worker_env import SERVER_VARIABLE, environ_set

WORKER_PRELOAD = (
    "ddpkit.launchers.server_start",
    "torch",
    "torch.distributed",
    "torch.distributed.elastic.multiprocessing",
    "torch._dynamo",  # torch.optim imports it when an optimizer is constructed: every training worker
    "ddpkit.launchers.worker_env",
    "ddpkit.launchers.output",
)
"""Modules the worker server imports once, in this order, so that no forked worker imports them again: what
every worker imports (torch's elastic wrapper runs each worker, an optimizer imports torch._dynamo, ddpkit's
worker_main sends its output to its files through ddpkit.launchers.output, then runs the user's code).
:mod:`ddpkit.launchers.server_start` comes first: it prepares the server before torch is imported."""

_server_users = 0
"""Open :func:`worker_server` blocks in this process."""


@contextlib.contextmanager
def worker_server() -> Iterator[None]:
    """Keep the warm process workers are forked from running for the block; nested blocks share one.

    The server starts importing :data:`WORKER_PRELOAD` at once, in its own
    process: call this before the launcher's own work (parsing the config
    imports torch too) and the two run side by side. It is stopped when the
    outermost block ends, so that no process outlives a launch.
    """
    global _server_users
    _server_users += 1
    try:  # (a Ctrl-C as the server starts still stops it)
        if _server_users == 1:
            _start_worker_server()
        yield
    finally:
        _server_users -= 1
        if _server_users == 0:
            _stop_worker_server()


def _start_worker_server() -> None:
    """Start the server, its Ctrl-C held until it ignores one (the launcher reports a Ctrl-C of this moment)."""
    multiprocessing.get_context("forkserver").set_forkserver_preload(list(WORKER_PRELOAD))
    # The resource tracker first: starting it unblocks SIGINT, which the server must be born with blocked.
    multiprocessing.resource_tracker.ensure_running()
    ctrl_c = {signal.SIGINT}
    held = signal.pthread_sigmask(signal.SIG_BLOCK, ctrl_c)
    try:
        # The server's environment only (workers get the launcher's): the launcher's pid, which it dies with.
        with environ_set(SERVER_VARIABLE, str(os.getpid())):
            multiprocessing.forkserver.ensure_running()
    finally:
        if signal.SIGINT not in held:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, ctrl_c)  # a Ctrl-C pressed meanwhile is raised here


def _stop_worker_server() -> None:
    # Killed, not asked to exit: its workers are gone and it holds nothing to
    # flush, while an interpreter that imported torch takes about a second to
    # tear itself down. ForkServer._stop (the standard library's own way to
    # stop its server, used by its tests) then reaps it and removes its socket.
    server: Any = multiprocessing.forkserver._forkserver  # private to the standard library, and untyped there
    if server._forkserver_pid is not None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(server._forkserver_pid, signal.SIGKILL)
    server._stop()
