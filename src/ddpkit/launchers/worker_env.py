"""What a worker starts from: the launcher's environment, its own process group, signals and title.

A worker forked from the worker server (:mod:`ddpkit.launchers.server`) gets
the server's environment, not the launcher's of the moment, so
:func:`worker_main` installs the launcher's environment as it was at the
launch, then the agent's per-worker variables over it, as a spawned worker
would have seen them. :func:`prepare_server` is what the server does first,
before its imports: it notes what its workers inherit from it.
"""

from __future__ import annotations

import contextlib
import gc
import io
import multiprocessing
import os
import signal
import sys
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from ddpkit.gc_pause import enable_in_forked_worker
from ddpkit.launchers.failure import FAILURE_DIR_VARIABLE, run_reporting_failure
from ddpkit.launchers.proctitle import set_process_title
from ddpkit.launchers.signals import INTERRUPTED_MARKER, die_with, ignore_in_server, libc_prctl, restore_in_worker
from ddpkit.names import EXIT_INTERRUPTED

SERVER_VARIABLE = "DDPKIT_WORKER_SERVER"
"""Set only in the worker server's environment, to the launcher's pid: the process the server dies with."""


@dataclass(frozen=True)
class ServerInheritance:
    """What a worker forked from the worker server inherits from it."""

    pid: int
    """The server's pid: the parent each worker must die with."""
    environ: Mapping[str, str]
    """The server's environment, over which the agent sets each worker's variables."""
    ignored_ctrl_c: bool
    """True when the server, not the launcher, made SIGINT ignored."""


_server: ServerInheritance | None = None
"""Set in the worker server (and so in its workers) by :func:`prepare_server`; None elsewhere."""


def prepare_server(launcher_pid: int) -> None:
    """Make this process the worker server: it dies with the launcher, ignores the job's signals, never collects.

    The server only imports, then forks: no collection while it imports
    torch, nor ever after, so that no page it shares with its workers is
    written by a collection. Each worker freezes what it inherits and
    collects again (:func:`worker_main`).
    """
    global _server
    environ = dict(os.environ)
    libc_prctl()  # resolved before any fork
    die_with(launcher_pid)
    _server = ServerInheritance(os.getpid(), environ, ignore_in_server())
    gc.disable()


def worker_main(
    launcher_pid: int,
    launcher_environ: Mapping[str, str],
    title: str,
    log_dir: str,
    fn: Callable[..., Any],
    *args: Any,
) -> Any:
    """A forked worker: the launcher's environment, its own process group and the default start method; ``fn``.

    The agent has set this worker's variables (RANK, LOCAL_RANK, ...) over
    the environment it was forked with (the server's, or the launcher's);
    they are kept over ``launcher_environ``, the launcher's environment at
    the launch. A variable the agent sets to the value the worker already
    had is taken from the launcher.

    In a process group of its own, the worker does not get the terminal's
    Ctrl-C: the launcher passes on one SIGINT per Ctrl-C
    (:class:`~ddpkit.launchers.signals.CtrlC`), so a worker can tell the
    first (checkpoint and stop) from the second (stop now). The agent's start
    method becomes a worker's own default; a DataLoader's workers are then
    forked as under ``python script.py`` or torchrun. ``fn`` runs with one
    failure report (:func:`run_reporting_failure`); a KeyboardInterrupt ends
    the worker with status 130 and no traceback.

    With a ``title`` (the program), the process is titled ``ddpkit rank r/w:
    TITLE``. With a ``log_dir`` (the launch's folder of rank files), the
    worker's stdout and stderr go to its files there
    (:func:`ddpkit.launchers.output.write_to_files`), line-buffered. Without
    one, a stdout that is not a terminal is made line-buffered, as on a
    terminal: Python would hold prints back until 8 KiB.
    """
    die_with(_server.pid if _server else launcher_pid)  # forked from the worker server, or from the launcher itself
    enable_in_forked_worker()  # the server never collects (see ddpkit.gc_pause)
    restore_in_worker(_server is not None and _server.ignored_ctrl_c)
    os.setpgrp()
    forked_with = _server.environ if _server else launcher_environ
    worker_variables = {k: v for k, v in os.environ.items() if forked_with.get(k) != v}
    os.environ.clear()
    os.environ.update(launcher_environ)
    os.environ.update(worker_variables)
    if title:
        rank, world_size = os.environ.get("RANK", "0"), os.environ.get("WORLD_SIZE", "1")
        set_process_title(f"ddpkit rank {rank}/{world_size}: {title}", f"r{rank}:{program_name(title)}")
    if isinstance(sys.stdout, io.TextIOWrapper) and not sys.stdout.isatty():  # (a notebook's stream is neither)
        sys.stdout.reconfigure(line_buffering=True)
    with _output_files(log_dir):
        folder = os.environ.get(FAILURE_DIR_VARIABLE, "")
        try:
            if folder and os.path.exists(os.path.join(folder, INTERRUPTED_MARKER)):
                raise KeyboardInterrupt  # a restart after Ctrl-C: the user asked to stop
            multiprocessing.set_start_method(None, force=True)
            result = run_reporting_failure(fn, *args)
        except KeyboardInterrupt:
            sys.exit(EXIT_INTERRUPTED)
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # done: a late Ctrl-C must not break the exit (atexit handlers)
        return result


def _output_files(log_dir: str) -> contextlib.AbstractContextManager[None]:
    """This worker's stdout and stderr into its files of this round in ``log_dir``; none: left as they are."""
    if not log_dir:
        return contextlib.nullcontext()
    # (Imported here: output imports torch, and the worker server imports this module before torch.)
    from ddpkit.launchers.output import log_files, write_to_files

    rank, restart = int(os.environ.get("RANK", "0")), int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    return write_to_files(*log_files(log_dir, rank, restart))


def program_name(title: str) -> str:
    """The program a title names, short: ``train.py`` (a script), ``pkg.train`` (``-m pkg.train``), ``ddpkit-train``."""
    words = title.split()
    if script := next((word for word in words if word.endswith(".py")), ""):
        return os.path.basename(script)
    if "-m" in words[:-1]:
        return words[words.index("-m") + 1]
    return "-".join(words[:2])


@contextlib.contextmanager
def environ_set(key: str, value: str) -> Iterator[None]:
    """Set ``key`` in os.environ for the block (spawned workers inherit it), then restore it."""
    previous = os.environ.get(key)
    os.environ[key] = value
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = previous


@contextlib.contextmanager
def environ_restored() -> Iterator[None]:
    """Give the caller its os.environ back: the agent writes into it (TORCHELASTIC_SIGNALS_TO_HANDLE)."""
    saved = dict(os.environ)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)
