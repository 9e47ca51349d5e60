"""Signals between the launcher, the worker server and the workers.

- Ctrl-C: each press is passed on to the workers once (:class:`CtrlC`); the
  first asks them to checkpoint and stop, the second to stop now, and those
  still running :data:`STOP_NOW_GRACE_S` later are killed.
- SIGTERM, SIGHUP, SIGQUIT and the preemption signals: torch's agent passes
  them on when it runs in the main thread (:data:`AGENT_SIGNALS`); otherwise
  :func:`signals_passed_on` does.
- A kill of the launcher that can pass nothing on (SIGKILL): every process of
  the run dies with the one that started it (:func:`die_with`).
- The worker server ignores the job's signals (:func:`ignore_in_server`),
  and each worker takes the defaults back (:func:`restore_in_worker`).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import multiprocessing
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from types import FrameType

AGENT_SIGNALS = ("SIGTERM", "SIGHUP", "SIGQUIT")
"""Signals torch's elastic agent handles (it also would SIGINT, which ddpkit's launcher handles itself):
passed on to the workers, which are then stopped."""
SERVER_IGNORES = ("SIGTERM", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2")
"""Signals the worker server ignores (and SIGINT, see :func:`ignore_in_server`): the launcher's to handle and pass on."""
INTERRUPTED_MARKER = "interrupted"
"""File in the launcher's failure folder once Ctrl-C was pressed: workers started after it (a restart) stop."""
STOP_NOW_GRACE_S = 2.0
"""Seconds the workers have to stop after a second Ctrl-C before they are killed."""

_PR_SET_PDEATHSIG = 1  # linux/prctl.h


@functools.cache
def libc_prctl() -> Callable[..., int] | None:
    """libc's prctl (None off Linux). Call it before any fork, in every process that forks workers.

    A forked worker must not dlopen: another thread of the launcher may have
    held the loader's lock when it forked.
    """
    if not sys.platform.startswith("linux"):
        return None
    prctl: Callable[..., int] = ctypes.CDLL(None, use_errno=True).prctl
    return prctl


def die_with(parent: int) -> None:
    """Have the kernel SIGKILL this process when ``parent`` (the process that started it) ends (Linux).

    The chain holds on every launch path: the worker server dies with the
    launcher, a worker with the server (or, forked from the launcher itself,
    with the launcher's thread that forked it), a DataLoader worker with its
    rank (:mod:`ddpkit.data.workers`). So a launcher killed with SIGKILL, which
    can pass nothing on, leaves no process of its run behind; a worker sits in
    a process group of its own, which a kill of the launcher's group misses.
    """
    prctl = libc_prctl()
    if prctl is None:
        return
    prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:
        os._exit(1)  # the parent died before the line above: nothing would stop this process


def ignore_in_server() -> bool:
    """In the worker server: ignore the job's signals; True if SIGINT was made ignored here.

    A signal sent to every process of the job (a process-group kill, Slurm's
    scancel --signal) must not kill the server: the launcher would read its
    workers' status from the dead server as exit code 255 while they still
    run (and checkpoint). Nor a Ctrl-C while it imports: multiprocessing
    ignores SIGINT in the server only once the imports are done, and the
    launcher, which starts the server before its own imports, has a Ctrl-C of
    that moment to report itself. The server was born with SIGINT blocked
    (:func:`ddpkit.launchers.server.worker_server`): one pressed since then is
    dropped here.
    """
    for name in SERVER_IGNORES:
        signal.signal(getattr(signal, name), signal.SIG_IGN)
    ignored_ctrl_c = signal.getsignal(signal.SIGINT) is signal.default_int_handler
    if ignored_ctrl_c:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    return ignored_ctrl_c


def restore_in_worker(server_ignored_ctrl_c: bool) -> None:
    """In a new worker: the default handlers of the signals the server ignored, and Python's of Ctrl-C."""
    for name in SERVER_IGNORES:  # (from the fork until here, a few milliseconds, they are ignored)
        signal.signal(getattr(signal, name), signal.SIG_DFL)
    if server_ignored_ctrl_c or signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
        # (Ignored by the launcher, in a background job: left so.) Forked from the launcher itself
        # (start_method "fork"), a worker inherits its handler of Ctrl-C.
        signal.signal(signal.SIGINT, signal.default_int_handler)


class CtrlC:
    """The launcher's SIGINT handler: each Ctrl-C is passed on to the workers once.

    The workers take the first as a preemption (finish the step, checkpoint,
    exit 130) and the second as "stop now": those still running
    :data:`STOP_NOW_GRACE_S` later (stuck in a collective) are killed. The
    first also leaves a marker, so that the agent's restarts
    (``max_restarts``) start nothing more.
    """

    def __init__(self, failure_dir: str):
        self.failure_dir = failure_dir
        self.count = 0
        """Ctrl-C presses so far."""
        self.kill_timer: threading.Timer | None = None
        """After the second: kills the workers still running (cancelled when the launch ends first)."""

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        self.count += 1
        if self.count == 1:
            open(os.path.join(self.failure_dir, INTERRUPTED_MARKER), "w").close()
            print(
                "\nddpkit: Ctrl-C: the workers finish their step, write a checkpoint and stop "
                "(Ctrl-C again to stop at once)",
                file=sys.stderr,
                flush=True,
            )
        workers = [child.pid for child in multiprocessing.active_children() if child.pid]  # the agent's workers
        for pid in workers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGINT)
        if self.count == 2:
            print("ddpkit: Ctrl-C again: stopping the workers now", file=sys.stderr, flush=True)
            # A worker inside a collective (a barrier a peer never joins) does not return to Python, where its
            # KeyboardInterrupt would be raised: after a moment to stop on its own, it is killed.
            self.kill_timer = threading.Timer(STOP_NOW_GRACE_S, _kill_process_groups, (workers,))
            self.kill_timer.daemon = True
            self.kill_timer.start()


def _kill_process_groups(pids: list[int]) -> None:
    """SIGKILL each worker of ``pids`` with its process group (its DataLoader workers and subprocesses)."""
    for pid in pids:
        try:
            os.killpg(pid, signal.SIGKILL)  # a worker leads a group of its own (ddpkit.launchers.worker_env)
        except ProcessLookupError:  # gone already, or not yet in its own group
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


@contextlib.contextmanager
def ctrl_c_passed_on(failure_dir: str) -> Iterator[CtrlC]:
    """Install :class:`CtrlC` for SIGINT for the block (main thread only), then restore the previous handler."""
    handler = CtrlC(failure_dir)
    try:
        previous = signal.signal(signal.SIGINT, handler)
    except ValueError:  # not the main thread: leave SIGINT alone
        yield handler
        return
    try:
        yield handler
    finally:
        signal.signal(signal.SIGINT, previous)
        if handler.kill_timer is not None:  # the workers are gone: their pids must not be killed later
            handler.kill_timer.cancel()


@contextlib.contextmanager
def signals_passed_on(names: tuple[str, ...], failure_dir: str) -> Iterator[None]:
    """For the block, pass each signal of ``names`` on to the workers instead of dying of it (main thread only).

    torch's agent does so itself (:data:`AGENT_SIGNALS`) when it runs in the
    main thread; with start_method "fork" it runs in a thread of its own,
    where Python cannot handle signals. Like Ctrl-C, a signal passed on
    leaves the marker that stops restarts: the job was asked to end.
    """

    def pass_on(signum: int, frame: FrameType | None) -> None:
        open(os.path.join(failure_dir, INTERRUPTED_MARKER), "w").close()
        for child in multiprocessing.active_children():
            if child.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(child.pid, signum)

    previous: dict[str, Callable[[int, FrameType | None], object] | int | signal.Handlers | None] = {}
    try:
        for name in names:
            previous[name] = signal.signal(getattr(signal, name), pass_on)
    except ValueError:  # not the main thread: leave the signals alone
        pass
    try:
        yield
    finally:
        for name, handler in previous.items():
            signal.signal(getattr(signal, name), handler)
