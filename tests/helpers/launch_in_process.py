"""Several ``ddpkit`` commands run in the test process, their workers forked from one worker server.

A ``ddpkit run`` or ``ddpkit train nproc=N`` command in a fresh process
spends most of its time importing torch twice: in the command's own
interpreter, and in the worker server its workers are forked from. Where the
command's process is not what a test is about (its exit path is checked by
tests/test_cli.py and by the tests that still start it), :class:`Commands`
runs the commands with :func:`ddpkit.cli.main` in this process, inside one
``worker_server()`` block: the launches share one warm server, as nested
blocks do in ddpkit itself, and the server is stopped when the block ends
(before the test's guard against stray child processes looks)::

    with Commands() as commands:
        first = commands.run("run", "nproc=2", "script.py", cwd=folder)
        again = commands.run("run", "nproc=2", "script.py", cwd=folder)
    assert first.returncode == 0, first.stderr

Each command's stdout and stderr are captured at the file-descriptor level:
the workers write to the server's descriptors, which are the ones this block
set before starting it. Workers receive the launcher's working folder and
``sys.path`` at each launch (multiprocessing's preparation data) and its
environment (ddpkit's ``_worker_main``), so the commands may run in different
folders with different variables. What the launcher leaves in this process
(its signal handlers, ddpkit's log handler, torch's thread count) is put back
when the block ends.
"""

from __future__ import annotations

import contextlib
import io
import logging
import multiprocessing
import os
import pickle
import queue
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ddpkit.cli import main
from ddpkit.launch.local import SERVER_IGNORES, worker_server
from tests.helpers.workers import RankFailed

LAUNCHER_VARIABLES = ("MASTER_", "OMPI_", "PMIX_", "PMI_", "SLURM_", "TORCHELASTIC_", "RANK", "WORLD_SIZE", "LOCAL_",
                      "GROUP_RANK", "SM_")
"""Prefixes of the variables of an outer launcher, which :meth:`Commands.run` can hide (``clean_environment``)."""

_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2")
"""Signals whose handlers a launch may set in this process (torch's agent does not put them back)."""


class Commands:
    """A block in which :meth:`run` runs ``ddpkit`` commands in this process with one shared worker server."""

    def __init__(self) -> None:
        self._stack = contextlib.ExitStack()
        self._files: tuple = ()
        self._text: list[io.TextIOWrapper] = []

    def __enter__(self) -> Commands:
        stack = self._stack.__enter__()
        try:
            self._keep_process_state(stack)
            self._files = tuple(stack.enter_context(tempfile.TemporaryFile()) for _ in range(2))
            for fd, file, stream in ((1, self._files[0], sys.stdout), (2, self._files[1], sys.stderr)):
                stream.flush()
                saved = os.dup(fd)
                stack.callback(os.close, saved)
                stack.callback(os.dup2, saved, fd)  # callbacks run last-in first-out: restored, then closed
                os.dup2(file.fileno(), fd)
            self._text = [io.TextIOWrapper(os.fdopen(os.dup(fd), "wb"), encoding="utf-8", errors="replace",
                                           write_through=True) for fd in (1, 2)]
            for stream in self._text:
                stack.callback(stream.close)
            stack.enter_context(contextlib.redirect_stdout(self._text[0]))
            stack.enter_context(contextlib.redirect_stderr(self._text[1]))
            stack.enter_context(worker_server())  # started now: it, and every worker, writes to the files above
        except BaseException:
            stack.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.__exit__(*exc)

    @staticmethod
    def _keep_process_state(stack: contextlib.ExitStack) -> None:
        handlers = {name: signal.getsignal(getattr(signal, name)) for name in _SIGNALS}
        stack.callback(lambda: [signal.signal(getattr(signal, n), h) for n, h in handlers.items()])
        logger = logging.getLogger("ddpkit")
        state = (list(logger.handlers), logger.level, logger.propagate)

        def restore_logger() -> None:
            logger.handlers[:] = state[0]
            logger.setLevel(state[1])
            logger.propagate = state[2]

        stack.callback(restore_logger)
        stack.callback(torch.set_num_threads, torch.get_num_threads())  # a command run here sets its own
        saved_path, saved_cwd = list(sys.path), os.getcwd()
        stack.callback(os.chdir, saved_cwd)
        stack.callback(lambda: sys.path.__setitem__(slice(None), saved_path))

    def run(self, *words: str, cwd: Path | str, env: Mapping[str, str] | None = None,
            clean_environment: bool = False) -> subprocess.CompletedProcess:
        """``ddpkit WORDS`` in ``cwd``, as ``python -m ddpkit WORDS`` would run there; its status and output.

        As the command's process does, the current folder is importable for the
        command (``model=mymodels:build``); modules imported from it are
        forgotten afterwards, so that another folder's module of the same name
        is imported afresh.

        Args:
            env: variables added to the environment for the command.
            clean_environment: hide the variables of an outer launcher (LAUNCHER_VARIABLES) from the command.
        """
        cwd = Path(cwd).resolve()
        imported = set(sys.modules)
        for file in self._files:
            file.seek(0)
            file.truncate()
        saved_environ, saved_path, saved_cwd = dict(os.environ), list(sys.path), os.getcwd()
        if clean_environment:
            for name in [k for k in os.environ if k.startswith(LAUNCHER_VARIABLES)]:
                del os.environ[name]
        os.environ.update(env or {})
        os.chdir(cwd)
        sys.path.insert(0, str(cwd))
        try:
            code = main(list(words))
        finally:
            os.chdir(saved_cwd)
            sys.path[:] = saved_path
            os.environ.clear()
            os.environ.update(saved_environ)
            _forget_modules_from(cwd, [name for name in sys.modules if name not in imported])
        out, err = (self._read(file) for file in self._files)
        return subprocess.CompletedProcess(["ddpkit", *words], code, out, err)

    def _read(self, file) -> str:
        for stream in self._text:
            stream.flush()
        file.seek(0)
        return file.read().decode("utf-8", errors="replace")


def _forget_modules_from(folder: Path, names: list[str]) -> None:
    """Remove the modules ``names`` that were imported from ``folder`` from sys.modules."""
    prefix = str(folder) + os.sep
    for name in names:
        if (getattr(sys.modules.get(name), "__file__", None) or "").startswith(prefix):
            del sys.modules[name]


def run_on_forked_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 240.0) -> list[Any]:
    """:func:`tests.helpers.workers.run_on_ranks` with ranks forked from ddpkit's worker server instead of spawned.

    ``fn(rank, world_size, *args)`` runs on ``world_size`` gloo ranks joined
    through a FileStore, as with ``run_on_ranks``; the ranks are forked from
    the worker server (torch, torch._dynamo and ddpkit's training code
    imported once) rather than each importing them again. Called inside a
    :class:`Commands` block or another ``worker_server()`` block, the ranks of
    several calls fork from one server.

    Returns:
        The values returned by ``fn``, indexed by rank.

    Raises:
        RankFailed: a rank raised, exited without a result, or the run timed out.
    """
    with worker_server():
        ctx = multiprocessing.get_context("forkserver")
        results = ctx.Queue()
        with tempfile.TemporaryDirectory(prefix="ddpkit-test-") as tmp:
            store = os.path.join(tmp, "store")
            environ = dict(os.environ)  # a forked rank starts with the server's environment: given this one instead
            procs = [ctx.Process(target=_forked_rank, args=(fn, rank, world_size, store, args, environ, results),
                                 daemon=True) for rank in range(world_size)]
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
                results.close()
                results.join_thread()


def _forked_rank(fn: Callable[..., Any], rank: int, world_size: int, store_path: str, args: tuple,
                 environ: Mapping[str, str], results: multiprocessing.Queue) -> None:
    for name in SERVER_IGNORES:  # the server ignores these; a rank takes the defaults back, as ddpkit's workers do
        signal.signal(getattr(signal, name), signal.SIG_DFL)
    os.environ.clear()
    os.environ.update(environ)
    torch.set_num_threads(1)  # N ranks share 2 cores; oversubscribed threads only slow tests
    try:
        dist.init_process_group("gloo", store=dist.FileStore(store_path, world_size), rank=rank,
                                world_size=world_size)
        # Plain pickle copies tensors; the queue's own pickler would share them through file descriptors
        # that die with this process.
        results.put((rank, "ok", pickle.dumps(fn(rank, world_size, *args))))
    except BaseException:  # everything, SystemExit included, goes to the parent
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _collect(procs: list, results: multiprocessing.Queue, world_size: int, timeout: float) -> list[Any]:
    """Each rank's value, by rank; the first error, a rank dead without a value, or the timeout raises RankFailed."""
    deadline = time.monotonic() + timeout
    values: dict[int, Any] = {}
    while len(values) < world_size:
        try:
            rank, status, value = results.get(timeout=0.2)
        except queue.Empty:
            dead = [r for r, p in enumerate(procs) if r not in values and p.exitcode not in (None, 0)]
            if dead and results.empty():
                time.sleep(0.5)  # its result may still be in the queue's pipe
                if results.empty():
                    raise RankFailed(f"rank {dead[0]} died with exit code {procs[dead[0]].exitcode} and no traceback")
            if time.monotonic() > deadline:
                missing = sorted(set(range(world_size)) - set(values))
                raise RankFailed(f"ranks {missing} did not finish within {timeout:.0f}s") from None
            continue
        if status == "error":
            raise RankFailed(f"rank {rank} of {world_size} failed:\n{value}")
        values[rank] = pickle.loads(value)
    return [values[r] for r in range(world_size)]
