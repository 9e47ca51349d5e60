"""Run a function on N real gloo ranks, with a hard timeout and one clear failure.

Every multi-process test goes through :func:`run_on_ranks`: it starts the
workers, joins them to one process group through a FileStore in a temporary
folder (no port to choose), and returns each rank's result. On the first
failure it kills the other ranks and raises with the failing rank's traceback;
past the timeout it kills them all and says which ranks never finished.

Starting workers
----------------
A spawned worker is a fresh interpreter that imports torch (about 1.5 s of
one core) and, at its first optimizer or DDP model, ``torch._dynamo`` (about
1 s more): on 2 cores, 4 ranks paid that 4 times over. The workers are forked
instead from multiprocessing's *forkserver*, a process that imports torch
once (:data:`PRELOAD`; and ``torch._dynamo`` where a test asks for it,
:data:`DYNAMO`) and forks each worker ready to run, as ``ddpkit run``
starts its own (``ddpkit.launchers.server``, where the reasons a fork is safe
are set out: the server only imports, so no thread, OpenMP pool, store or
CUDA context exists when it forks). The server lives for one
:func:`run_on_ranks` call, or for a :func:`warm_workers` block that several
calls share, so that no process outlives a test. A worker starts from the
caller's ``os.environ`` as it is at the call (as a spawned one would), not
from the server's.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import multiprocessing.forkserver
import os
import pickle
import queue
import signal
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Mapping
from typing import Any

DEFAULT_TIMEOUT = 120.0

PRELOAD = ("torch", "torch.distributed", "torch.nn.parallel", "tests.helpers.workers")
"""Modules the worker server imports once, so that no forked worker imports them again."""

DYNAMO = ("torch._dynamo",)
"""What the first optimizer or DistributedDataParallel of a process imports (about 1 s of a core, each rank):
preload it with ``warm_workers(DYNAMO)`` where the ranks build one, so that the server imports it once. Not
by default: ranks that build neither would only wait for it."""

_server_lock = threading.Lock()
_server_users = 0
_server_ours = False
_preload_before: list[str] = []


class RankFailed(AssertionError):
    """A rank raised, died or timed out; the message carries its traceback."""


@contextlib.contextmanager
def warm_workers(preload: tuple[str, ...] = ()) -> Iterator[mp.context.BaseContext]:
    """A multiprocessing context whose processes fork from one warm server, for the block.

    Nested blocks, and :func:`run_on_ranks` calls inside one, share the
    server (from any thread); it is stopped when the outermost block ends.
    Where another forkserver of this process is running already
    (``ddpkit.launchers.server``'s), processes are spawned instead of sharing a
    server set up for other ends.

    Args:
        preload: modules the server imports besides :data:`PRELOAD` (only when this block starts it).

    Yields:
        The context to create processes and queues with.
    """
    global _server_users, _server_ours, _preload_before
    forkserver = multiprocessing.forkserver._forkserver
    with _server_lock:
        if _server_users == 0:
            _server_ours = forkserver._forkserver_pid is None
            if _server_ours:
                _preload_before = list(forkserver._preload_modules)
                forkserver.set_forkserver_preload([*PRELOAD, *preload])
                forkserver.ensure_running()
        _server_users += 1
        ours = _server_ours
    try:
        yield mp.get_context("forkserver" if ours else "spawn")
    finally:
        with _server_lock:
            _server_users -= 1
            if _server_users == 0 and _server_ours:
                _stop_server(forkserver)


def _stop_server(forkserver: Any) -> None:
    # Killed rather than asked to exit: an interpreter that imported torch
    # takes about a second to tear itself down. _stop then reaps it and
    # removes its socket (the standard library's own way to stop it).
    if forkserver._forkserver_pid is not None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(forkserver._forkserver_pid, signal.SIGKILL)
    forkserver._stop()
    forkserver.set_forkserver_preload(_preload_before)


def _worker(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    store_path: str,
    args: tuple,
    caller_environ: Mapping[str, str],
    environ: Mapping[str, str],
    init_process_group: bool,
    results: mp.Queue,
) -> None:
    import torch
    import torch.distributed as dist

    # A forked worker holds the server's environment: give it the caller's, as a spawned one would have.
    os.environ.clear()
    os.environ.update(caller_environ)
    os.environ.update(environ)
    torch.set_num_threads(1)  # N ranks share 2 cores; oversubscribed threads only slow tests
    try:
        if init_process_group:
            store = dist.FileStore(store_path, world_size)
            dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
        # Plain pickle copies tensors; the queue's own pickler would share them
        # through file descriptors that die with this process.
        value = pickle.dumps(fn(rank, world_size, *args))
        results.put((rank, "ok", value))
    except BaseException:  # report everything, including SystemExit, to the parent
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if init_process_group and dist.is_initialized():
            dist.destroy_process_group()


def run_on_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = DEFAULT_TIMEOUT,
    environ: Mapping[str, str] | None = None,
    init_process_group: bool = True,
) -> list[Any]:
    """Call ``fn(rank, world_size, *args)`` on ``world_size`` worker processes.

    Args:
        fn: a module-level function (it is pickled by reference).
        world_size: number of ranks to start.
        *args: extra picklable arguments passed to every rank.
        timeout: seconds for the whole run before every rank is killed.
        environ: extra environment variables set in each rank before ``fn``.
        init_process_group: join the ranks into a gloo process group first.

    Returns:
        The values returned by ``fn``, indexed by rank.

    Raises:
        RankFailed: a rank raised, exited without a result, or the run timed out.
    """
    with warm_workers() as ctx, tempfile.TemporaryDirectory(prefix="ddpkit-test-") as tmp:
        results: mp.Queue = ctx.Queue()
        store_path = os.path.join(tmp, "store")
        caller_environ = dict(os.environ)
        procs = [
            ctx.Process(
                target=_worker,
                args=(
                    fn,
                    rank,
                    world_size,
                    store_path,
                    args,
                    caller_environ,
                    dict(environ or {}),
                    init_process_group,
                    results,
                ),
                daemon=True,
            )
            for rank in range(world_size)
        ]
        for p in procs:
            p.start()
        try:
            return _collect(procs, results, world_size, timeout)
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
            for p in procs:
                p.join(5)


def _collect(procs: list, results: mp.Queue, world_size: int, timeout: float) -> list[Any]:
    deadline = time.monotonic() + timeout
    values: dict[int, Any] = {}
    exited_without_result: dict[int, float] = {}  # rank -> when its exit was first seen
    while len(values) < world_size:
        try:
            rank, status, value = results.get(timeout=0.05 if exited_without_result else 0.2)
        except queue.Empty:
            _check_for_dead_ranks(procs, values, exited_without_result)
            if time.monotonic() > deadline:
                missing = sorted(set(range(world_size)) - set(values))
                raise RankFailed(f"ranks {missing} did not finish within {timeout:.0f}s") from None
            continue
        if status == "error":
            raise RankFailed(f"rank {rank} of {world_size} failed:\n{value}")
        values[rank] = pickle.loads(value)
    return [values[r] for r in range(world_size)]


def _check_for_dead_ranks(procs: list, values: dict[int, Any], exited: dict[int, float]) -> None:
    now = time.monotonic()
    for rank, p in enumerate(procs):
        if rank not in values and p.exitcode is not None:
            # Its result may still be on its way (the queue's feeder thread may lag the exit):
            # keep reading the queue for a moment before calling it dead.
            if now - exited.setdefault(rank, now) < 0.5:
                continue
            if p.exitcode != 0:
                raise RankFailed(f"rank {rank} died with exit code {p.exitcode} and no traceback")
