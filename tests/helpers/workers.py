"""Run a function on N real gloo ranks, with a hard timeout and one clear failure.

Every multi-process test goes through :func:`run_on_ranks`: it spawns the
workers, joins them to one process group through a FileStore in a temporary
folder (no port to choose), and returns each rank's result. On the first
failure it kills the other ranks and raises with the failing rank's traceback;
past the timeout it kills them all and says which ranks never finished.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping
from typing import Any

DEFAULT_TIMEOUT = 120.0


class RankFailed(AssertionError):
    """A rank raised, died or timed out; the message carries its traceback."""


def _worker(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    store_path: str,
    args: tuple,
    environ: Mapping[str, str],
    init_process_group: bool,
    results: mp.Queue,
) -> None:
    import torch
    import torch.distributed as dist

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
    """Call ``fn(rank, world_size, *args)`` on ``world_size`` spawned processes.

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
    ctx = mp.get_context("spawn")
    results: mp.Queue = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="ddpkit-test-") as tmp:
        store_path = os.path.join(tmp, "store")
        procs = [
            ctx.Process(
                target=_worker,
                args=(fn, rank, world_size, store_path, args, dict(environ or {}), init_process_group, results),
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
    while len(values) < world_size:
        try:
            rank, status, value = results.get(timeout=0.2)
        except queue.Empty:
            _check_for_dead_ranks(procs, values)
            if time.monotonic() > deadline:
                missing = sorted(set(range(world_size)) - set(values))
                raise RankFailed(f"ranks {missing} did not finish within {timeout:.0f}s") from None
            continue
        if status == "error":
            raise RankFailed(f"rank {rank} of {world_size} failed:\n{value}")
        values[rank] = pickle.loads(value)
    return [values[r] for r in range(world_size)]


def _check_for_dead_ranks(procs: list, values: dict[int, Any]) -> None:
    for rank, p in enumerate(procs):
        if rank not in values and p.exitcode is not None:
            # Give its result a moment to arrive: the queue feeder may lag the exit.
            time.sleep(0.5)
            if p.exitcode != 0:
                raise RankFailed(f"rank {rank} died with exit code {p.exitcode} and no traceback")
