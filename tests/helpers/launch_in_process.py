"""Several ``ddpkit`` commands run in the test process, their workers forked from one worker server.

A ``ddpkit run`` or ``ddpkit train nproc=N`` command in a fresh process
spends most of its time importing torch twice: in the command's own
interpreter, and in the worker server its workers are forked from. Where the
command's process is not what a test is about (its exit path is checked by
tests/test_cli.py and by the tests that still start it), :class:`Commands`
runs the commands with :func:`ddpkit.commands.dispatch.main` in this process, inside one
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
environment (``ddpkit.launchers.worker_env.worker_main``), so the commands may run in different
folders with different variables. What the launcher leaves in this process
(its signal handlers, ddpkit's log handler, torch's thread count, the
forkserver's preload list) is put back when the block ends.
"""

from __future__ import annotations

import contextlib
import io
import logging
import multiprocessing.forkserver
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path

import torch

from ddpkit.commands.dispatch import main
from ddpkit.launchers.server import worker_server

LAUNCHER_VARIABLES = (
    "MASTER_",
    "OMPI_",
    "PMIX_",
    "PMI_",
    "SLURM_",
    "TORCHELASTIC_",
    "RANK",
    "WORLD_SIZE",
    "LOCAL_",
    "GROUP_RANK",
    "SM_",
)
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
            self._text = [
                io.TextIOWrapper(os.fdopen(os.dup(fd), "wb"), encoding="utf-8", errors="replace", write_through=True)
                for fd in (1, 2)
            ]
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
        forkserver = multiprocessing.forkserver._forkserver  # worker_server() sets its preload for good
        stack.callback(forkserver.set_forkserver_preload, list(forkserver._preload_modules))
        saved_path, saved_cwd = list(sys.path), os.getcwd()
        stack.callback(os.chdir, saved_cwd)
        stack.callback(lambda: sys.path.__setitem__(slice(None), saved_path))

    def run(
        self, *words: str, cwd: Path | str, env: Mapping[str, str] | None = None, clean_environment: bool = False
    ) -> subprocess.CompletedProcess:
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
