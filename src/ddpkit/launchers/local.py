"""Starting N workers on this machine through torch's elastic launcher.

``launch_local`` is ``torchrun --standalone --nproc-per-node N`` as a
function: torch's elastic agent starts the workers, supervises them, stops
them all when one fails, and restarts the group up to ``max_restarts`` times.
A job of several machines (or containers) runs it on each, as ``torchrun
--nnodes N --node-rank R --master-addr HOST --master-port P`` does: torch's
static rendezvous, whose store node 0's agent hosts at ``master_port``; the
agents agree on the run by that address and port alone, so the same command
on every node, with its own ``node_rank``, makes the job. ddpkit adds what
the command lacks:

- on one node, a rendezvous on loopback (``127.0.0.1``) at a free port asked
  from the OS (or the one given, checked first), and a fresh loopback store
  for each round of workers (:mod:`ddpkit.launchers.loopback`), so nothing
  listens on the network and a restarted round never reads the keys of the
  one before;
- on several nodes, node 0's store served on the address it reaches
  ``master_addr`` from only, not on every interface
  (:mod:`ddpkit.launchers.static`);
- one report of the root-cause failure (:mod:`ddpkit.launchers.failure`)
  instead of every worker's traceback;
- workers forked from a warm process instead of spawned (see below);
- a worker that ends with ``os._exit(0)``, returning nothing, counts as
  finished (torch's agent would wait for its return value forever);
- each worker's stdout and stderr in files of its own, the chosen ranks'
  lines on the console prefixed ``[rank r/w]`` (:mod:`ddpkit.launchers.output`),
  and a process title that names the rank and the program
  (:mod:`ddpkit.launchers.proctitle`);
- a signal to the launcher (SIGTERM from a scheduler) is passed on to the
  workers as torchrun does, and :class:`StoppedBySignal` then says how each
  worker ended, so that the command's exit status can say whether they
  checkpointed (all exited 75) or died.

Pipeline: LaunchSpec -> LaunchConfig (torch) -> elastic_launch -> results
by rank, or LaunchError carrying the root cause, or StoppedBySignal.

``LaunchSpec(start_method="fork")`` forks the workers from this process
instead, as it is, so that ``fn`` need not be importable (a function
defined in a notebook cell or a REPL: :mod:`ddpkit.launchers.function`, which
also says when such a fork is safe). The agent then runs in a thread of its
own, which forks every worker (see :func:`_in_a_thread_of_its_own`), while
the caller's thread passes the job's signals on to the workers.

Starting workers fast
---------------------
A spawned worker is a fresh interpreter that imports torch again (about
1.5 s of one core each, plus about 1 s for ``torch._dynamo``, which the
first optimizer pulls in). The agent starts its workers with
multiprocessing's *forkserver* instead: one server process imports torch,
``torch._dynamo`` and ddpkit once (:data:`WORKER_PRELOAD`), and every worker
is a fork of it, ready at once. ``ddpkit train`` starts the server as its
first act (:func:`worker_server`), so the server's imports run beside the
launcher's own on the other core.

Why a fork here is safe: the server only imports. It never runs a torch
operator nor asks for the thread count, so torch's intra-op (OpenMP) pool
and autograd threads do not exist when it forks (the server has one thread,
which tests/launchers/test_worker_server.py checks); it never initializes CUDA,
joins no process group and holds no store or socket of torch's. A forked worker gets the
server's environment, not the launcher's of the moment, so
:func:`_worker_main` installs the launcher's environment as it was at the
launch, then the agent's per-worker variables over it, as a spawned worker
would have seen them. The server ignores the signals the launcher handles
(a signal sent to the whole job must not kill it while its workers run);
each worker takes the default handlers back. The server is stopped when the
launch ends.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import gc
import io
import logging
import multiprocessing
import multiprocessing.forkserver
import multiprocessing.resource_tracker
import os
import signal
import socket
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

# torch is imported inside launch_local: `ddpkit train` starts the worker
# server (below) before this process imports torch itself.
from ddpkit.env.ports import free_port
from ddpkit.errors import UserError
from ddpkit.gc_pause import enable_in_forked_worker
from ddpkit.launchers.failure import (
    FAILURE_DIR_VARIABLE,
    LaunchError,
    WorkerFailure,
    append_to_output,
    recorded_failures,
    root_cause,
    run_reporting_failure,
)
from ddpkit.launchers.proctitle import set_process_title
from ddpkit.names import EXIT_INTERRUPTED, EXIT_PREEMPTED

if TYPE_CHECKING:
    from ddpkit.launchers.output import ConsoleTee

LOOPBACK = "127.0.0.1"
AGENT_SIGNALS = ("SIGTERM", "SIGHUP", "SIGQUIT")
"""Signals torch's elastic agent handles (it also would SIGINT, which ddpkit's launcher handles itself):
passed on to the workers, which are then stopped."""
INTERRUPTED_MARKER = "interrupted"
"""File in the launcher's failure folder once Ctrl-C was pressed: workers started after it (a restart) stop."""
AGENTS_LEFT_KEY = "ddpkit/agents_left_exit_barrier"
"""Store key each node's agent increments once past torch's exit barrier (see _host_outlives_the_exit_barrier)."""
STOP_NOW_GRACE_S = 2.0
"""Seconds the workers have to stop after a second Ctrl-C before they are killed."""
EXIT_BARRIER_GRACE_S = 30.0
"""The longest node 0's agent waits, past the exit barrier, for the other agents to leave it."""

WORKER_PRELOAD = (
    "ddpkit.launchers.local",
    "torch",
    "torch._dynamo",
    "torch.distributed.elastic.multiprocessing",
    "ddpkit.train.run",
)
"""Modules the worker server imports once, in this order, so that no forked worker imports them again.
This module comes first: in the server it turns garbage collection off before torch is imported."""

SERVER_IGNORES = ("SIGTERM", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2")
"""Signals the worker server ignores (and SIGINT, see below): the launcher's to handle and pass on."""

_SERVER_VARIABLE = "DDPKIT_WORKER_SERVER"
# Set only in the worker server's environment, so that this module knows it is being preloaded there.

_ENVIRON_AT_IMPORT = dict(os.environ)
# In the worker server (which imports this module first thing), its own environment: what
# every worker it forks starts from, before the agent sets its per-worker variables.

_server_users = 0

_SERVER_IGNORED_CTRL_C = False
"""True in the worker server (and so in its workers) when it, not the launcher, made SIGINT ignored."""

_PR_SET_PDEATHSIG = 1  # linux/prctl.h
_PRCTL = ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else None
# libc's prctl, resolved here, in the launcher and in the server, before any fork: a forked worker must not
# dlopen (another thread of the launcher may have held the loader's lock when it forked).

_SERVER_PID = 0
"""In the worker server (and so in its workers), the server's pid: the parent each worker must die with."""


def _die_with(parent: int) -> None:
    """Have the kernel SIGKILL this process when ``parent`` (the process that started it) ends (Linux).

    The chain holds on every launch path: the worker server dies with the
    launcher, a worker with the server (or, forked from the launcher itself,
    with the launcher's thread that forked it), a DataLoader worker with its
    rank (:mod:`ddpkit.data.workers`). So a launcher killed with SIGKILL, which
    can pass nothing on, leaves no process of its run behind; a worker sits in
    a process group of its own, which a kill of the launcher's group misses.
    """
    if _PRCTL is None:
        return
    _PRCTL(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:
        os._exit(1)  # the parent died before the line above: nothing would stop this process


if (_launcher := os.environ.get(_SERVER_VARIABLE, "")).isdigit():
    _die_with(int(_launcher))  # the launcher's pid, set in the server's environment by _start_worker_server
    _SERVER_PID = os.getpid()
    # A signal sent to every process of the job (a process-group kill, Slurm's
    # scancel --signal) must not kill the server: the launcher would read its
    # workers' status from the dead server as exit code 255 while they still
    # run (and checkpoint). Workers set these signals back to the default.
    for _name in SERVER_IGNORES:
        signal.signal(getattr(signal, _name), signal.SIG_IGN)
    # Nor a Ctrl-C while it imports: multiprocessing ignores SIGINT in the server only once the
    # imports are done, and the launcher, which starts the server before its own imports, has a
    # Ctrl-C of that moment to report itself. The server was born with SIGINT blocked (see
    # _start_worker_server): one pressed since then is dropped here. Workers take Python's handler back.
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        _SERVER_IGNORED_CTRL_C = True
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    # The server only imports, then forks: no collection while it imports torch (about a quarter of
    # torch._dynamo's import time), nor ever after, so that no page it shares with its workers is
    # written by a collection. Each worker freezes what it inherits and collects again (_worker_main).
    gc.disable()


@dataclass(frozen=True)
class LaunchSpec:
    """How to start workers on this machine."""

    nproc: int
    """Number of workers."""
    master_port: int = 0
    """Rendezvous port on 127.0.0.1; 0 asks the OS for a free one."""
    max_restarts: int = 0
    """Times the whole group is restarted after a worker fails."""
    monitor_interval: float = 0.1
    """Seconds between the agent's checks of its workers."""
    forward_signals: tuple[str, ...] = ()
    """Signals, besides SIGTERM, SIGINT, SIGHUP and SIGQUIT, that the agent passes on to the workers
    (then waits for them, then stops them) instead of dying of them: the preemption signals."""
    nnodes: int = 1
    """Machines of the job, each running a launcher with its own node_rank."""
    node_rank: int = 0
    """This machine's index among the nnodes; node 0 hosts the rendezvous."""
    master_addr: str = ""
    """Host name or address of node 0 (nnodes > 1)."""
    rendezvous_timeout: float = 600.0
    """Seconds the nodes wait for each other at the rendezvous (nnodes > 1)."""
    start_method: str = "forkserver"
    """How workers start: "forkserver", forked from ddpkit's warm worker server (``fn`` and its arguments are
    pickled, so ``fn`` must be importable), or "fork", forked from this process as it is (nothing is pickled)."""
    log_dir: str = ""
    """Folder of each worker's stdout and stderr files (ddpkit.launchers.output), created for this launch (where
    it exists already, another launch's, ``log_dir-2``, ``-3``...); empty: the workers write to this process's
    stdout and stderr, as they are."""
    show_ranks: frozenset[int] | None = None
    """With log_dir: the global ranks whose lines this process's stdout and stderr show; None: all."""
    title: str = ""
    """The program, as worker process titles name it after "ddpkit rank r/w: " (e.g. "train.py --lr 0.1")."""


class StoppedBySignal(RuntimeError):
    """The launcher received ``signal_name``, passed it on to the workers and waited for them (torch's agent).

    ``exit_codes`` says how each worker ended, by global rank (negative: killed by that signal; empty when the
    signal came while no worker ran).
    """

    def __init__(self, signal_name: str, exit_codes: Mapping[int, int | None]):
        self.signal_name = signal_name
        self.exit_codes = dict(exit_codes)
        super().__init__(f"stopped by {signal_name}; the workers' exit codes: {self.exit_codes}")

    @property
    def checkpointed_status(self) -> int | None:
        """EXIT_PREEMPTED (or EXIT_INTERRUPTED) when every worker that had not finished exited with it, else None.

        Workers exit so only after their preemption checkpoint is complete (ddpkit.Checkpointer), so this
        status means "the work is saved: run the same command again".
        """
        ended = {code for code in self.exit_codes.values() if code != 0}
        if len(ended) == 1 and (code := ended.pop()) in (EXIT_PREEMPTED, EXIT_INTERRUPTED):
            return code
        return None


def check_port_free(port: int, host: str = LOOPBACK) -> None:
    """Raise ValueError if ``port`` cannot be bound on ``host`` (an IPv4 or IPv6 address)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            # One node may ask the OS for a port; several must agree on one beforehand.
            fix = "choose another port or master_port=0" if host == LOOPBACK else "choose another port on every node"
            raise UserError(f"master_port={port} is already in use on {host}; {fix}") from None


def _quiet_elastic_logs() -> None:
    # The agent logs every lifecycle step, and each failure with a traceback of
    # its own polling code; ddpkit reports the root cause itself.
    prefixes = ("torch.distributed.elastic", "torch.distributed.launcher", "torch.multiprocessing")
    for name in [*prefixes, *logging.root.manager.loggerDict]:
        if name.startswith(prefixes):
            logging.getLogger(name).setLevel(logging.CRITICAL)


def _fresh_store_per_restart() -> contextlib.AbstractContextManager:
    # torch's c10d rendezvous would share its own store with the workers across rounds, served on every
    # interface (pytorch/pytorch#135712: restarted workers then read the dead workers' gloo addresses).
    # Not shared, it only hands out an address, and ddpkit's loopback backend serves each round a new
    # store instead (read by the agent at each rendezvous, so set for the launch only).
    return _environ("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")


@contextlib.contextmanager
def _environ(key: str, value: str) -> Iterator[None]:
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
        with _environ(_SERVER_VARIABLE, str(os.getpid())):
            multiprocessing.forkserver.ensure_running()
    finally:
        if signal.SIGINT not in held:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, ctrl_c)  # a Ctrl-C pressed meanwhile is raised here


def _stop_worker_server() -> None:
    # Killed, not asked to exit: its workers are gone and it holds nothing to
    # flush, while an interpreter that imported torch takes about a second to
    # tear itself down. ForkServer._stop (the standard library's own way to
    # stop its server, used by its tests) then reaps it and removes its socket.
    server = multiprocessing.forkserver._forkserver
    if server._forkserver_pid is not None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(server._forkserver_pid, signal.SIGKILL)
    server._stop()


def _finish_workers_that_exit_without_returning() -> None:
    """Make torch's agent take a worker that exited with status 0 but returned nothing as finished.

    torch's ``MultiprocessContext`` waits for every worker's return value,
    which its wrapper sends after the worker's function returns. A worker
    that ends with ``os._exit(0)`` (a script skipping its interpreter's
    teardown) sends none: the agent then polls forever, although every
    worker is gone. Once all workers have exited with status 0, the ones
    without a value are taken as having returned None. Installed once, in
    the launcher's process only; a non-zero exit stays a failure.
    """
    from torch.distributed.elastic.multiprocessing.api import MultiprocessContext, RunProcsResult

    torch_poll = MultiprocessContext._poll
    if getattr(torch_poll, "ddpkit_finishes_silent_exits", False):
        return

    def poll(self: MultiprocessContext) -> RunProcsResult | None:
        result = torch_poll(self)
        if result is not None or self._pc is None or self._pc.sentinels:
            return result  # done, failed, or a worker still runs
        for local_rank, queue in self._ret_vals.items():
            if local_rank not in self._return_values:
                self._return_values[local_rank] = None if queue.empty() else queue.get()
        self._worker_finished_event.set()
        self.close()
        return RunProcsResult(return_values=self._return_values, stdouts=self.stdouts, stderrs=self.stderrs)

    poll.ddpkit_finishes_silent_exits = True
    MultiprocessContext._poll = poll


def _announce_restarts() -> None:
    """Make torch's agent print one line per restart: which rank failed, how, and restart k of n.

    The agent restarts the group silently (its own logs are quieted: see
    ``_quiet_elastic_logs``). Installed once, in the launcher's process only.
    """
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    if getattr(LocalElasticAgent._restart_workers, "ddpkit_announces", False):
        return
    torch_monitor, torch_restart = LocalElasticAgent._monitor_workers, LocalElasticAgent._restart_workers

    def monitor(self: LocalElasticAgent, worker_group: Any) -> Any:
        result = torch_monitor(self, worker_group)
        self.ddpkit_failures = result.failures
        return result

    def restart(self: LocalElasticAgent, worker_group: Any) -> None:
        limit = worker_group.spec.max_restarts
        print(
            f"ddpkit: {_first_failure(getattr(self, 'ddpkit_failures', {}))}; restarting the workers "
            f"(restart {limit - self._remaining_restarts} of {limit}); they resume from the newest checkpoint",
            file=sys.stderr,
            flush=True,
        )
        torch_restart(self, worker_group)

    restart.ddpkit_announces = True
    LocalElasticAgent._monitor_workers = monitor
    LocalElasticAgent._restart_workers = restart


def _host_outlives_the_exit_barrier() -> None:
    """Keep node 0's agent, which serves the rendezvous store, until every node's agent has left the exit barrier.

    torch's agents meet at an exit barrier when their workers are done; node 0's
    returns as soon as the last one arrives and its process exits, closing the
    store while another node's agent may still be reading the barrier's answer
    from it. That agent then prints c10d's "Failed to recv ... Did the remote
    server shutdown or crash?" with a C++ stack, after a job that succeeded.
    Installed once, in the launcher's process only.
    """
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    if getattr(LocalElasticAgent._exit_barrier, "ddpkit_waits", False):
        return
    torch_exit_barrier = LocalElasticAgent._exit_barrier

    def exit_barrier(self: LocalElasticAgent) -> None:
        torch_exit_barrier(self)
        group = self._worker_group
        if group.group_world_size < 2:
            return
        try:
            left = self._store.add(AGENTS_LEFT_KEY, 1)
            deadline = time.monotonic() + EXIT_BARRIER_GRACE_S
            while group.group_rank == 0 and left < group.group_world_size and time.monotonic() < deadline:
                time.sleep(0.05)
                left = self._store.add(AGENTS_LEFT_KEY, 0)
        except RuntimeError:  # the store is gone (node 0 ended first after all): nothing left to wait for
            pass

    exit_barrier.ddpkit_waits = True
    LocalElasticAgent._exit_barrier = exit_barrier


def _exit_codes_at_shutdown() -> None:
    """Make torch's agent note how its workers ended when a signal stopped it, for :class:`StoppedBySignal`.

    On a signal the agent passes it on to the workers, waits for them (then
    kills those left) and re-raises its ``SignalException``, which carries
    only the signal. Its ``_shutdown`` runs inside that ``except`` block, so
    the wrapper below finds the exception there and attaches the workers'
    exit codes by global rank (read by :func:`launch_local` only). Installed
    once, in the launcher's process only.
    """
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
    from torch.distributed.elastic.multiprocessing.api import SignalException

    if getattr(LocalElasticAgent._shutdown, "ddpkit_notes_exit_codes", False):
        return
    torch_shutdown = LocalElasticAgent._shutdown

    def shutdown(self: LocalElasticAgent, *args: Any, **kwargs: Any) -> None:
        torch_shutdown(self, *args, **kwargs)
        handled = sys.exc_info()[1]
        processes = getattr(getattr(self._pcontext, "_pc", None), "processes", None)  # forkserver workers
        if isinstance(handled, SignalException) and processes is not None:
            ranks = {worker.local_rank: worker.global_rank for worker in self._worker_group.workers}
            handled.ddpkit_exit_codes = {  # type: ignore[attr-defined]
                ranks.get(local_rank, local_rank): process.exitcode for local_rank, process in enumerate(processes)
            }

    shutdown.ddpkit_notes_exit_codes = True
    LocalElasticAgent._shutdown = shutdown


def _first_failure(failures: Mapping[int, Any]) -> str:
    """'rank 1 was killed by SIGKILL' for the earliest of a round's failures (the root cause)."""
    if not failures:
        return "a worker failed"
    rank, failure = min(failures.items(), key=lambda item: item[1].timestamp)
    if failure.exitcode < 0:
        return f"rank {rank} was killed by {failure.signal_name()}"
    return f"rank {rank} exited with status {failure.exitcode}"


@contextlib.contextmanager
def _environ_restored() -> Iterator[None]:
    """Give the caller its os.environ back: the agent writes into it (TORCHELASTIC_SIGNALS_TO_HANDLE)."""
    saved = dict(os.environ)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _worker_main(
    launcher_pid: int, launcher_environ: Mapping[str, str], title: str, fn: Callable[..., Any], *args: Any
) -> Any:
    """A forked worker: the launcher's environment, its own process group and the default start method; ``fn``.

    The agent has set this worker's variables (RANK, LOCAL_RANK, ...) over
    the server's environment; they are kept over ``launcher_environ``, the
    launcher's environment at the launch. A variable the agent sets to the
    value the server already had is taken from the launcher.

    In a process group of its own, the worker does not get the terminal's
    Ctrl-C: the launcher passes on one SIGINT per Ctrl-C (see
    :class:`_CtrlC`), so a worker can tell the first (checkpoint and stop)
    from the second (stop now). The agent's start method becomes a worker's
    own default; a DataLoader's workers are then forked as under ``python
    script.py`` or torchrun. ``fn`` runs with one failure report
    (:func:`run_reporting_failure`); a KeyboardInterrupt ends the worker with
    status 130 and no traceback.

    With a ``title`` (the program), the process is titled ``ddpkit rank r/w:
    TITLE``. A stdout that is not a terminal (the agent redirected it into
    its file) is made line-buffered, as on a terminal: Python would hold
    prints back until 8 KiB.
    """
    _die_with(_SERVER_PID or launcher_pid)  # forked from the worker server, or from the launcher itself
    enable_in_forked_worker()  # the server never collects (see ddpkit.gc_pause)
    for name in SERVER_IGNORES:  # (from the fork until here, a few milliseconds, they are ignored)
        signal.signal(getattr(signal, name), signal.SIG_DFL)
    if _SERVER_IGNORED_CTRL_C or signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
        # (Ignored by the launcher, in a background job: left so.) Forked from the launcher itself
        # (start_method "fork"), a worker inherits its handler of Ctrl-C.
        signal.signal(signal.SIGINT, signal.default_int_handler)
    os.setpgrp()
    worker_variables = {k: v for k, v in os.environ.items() if _ENVIRON_AT_IMPORT.get(k) != v}
    os.environ.clear()
    os.environ.update(launcher_environ)
    os.environ.update(worker_variables)
    if title:
        rank, world_size = os.environ.get("RANK", "0"), os.environ.get("WORLD_SIZE", "1")
        set_process_title(f"ddpkit rank {rank}/{world_size}: {title}", f"r{rank}:{_program_name(title)}")
    if isinstance(sys.stdout, io.TextIOWrapper) and not sys.stdout.isatty():  # (a notebook's stream is neither)
        sys.stdout.reconfigure(line_buffering=True)
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


def _program_name(title: str) -> str:
    """The program a title names, short: ``train.py`` (a script), ``pkg.train`` (``-m pkg.train``), ``ddpkit-train``."""
    words = title.split()
    if script := next((word for word in words if word.endswith(".py")), ""):
        return os.path.basename(script)
    if "-m" in words[:-1]:
        return words[words.index("-m") + 1]
    return "-".join(words[:2])


class _CtrlC:
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

    def __call__(self, signum: int, frame: Any) -> None:
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
            os.killpg(pid, signal.SIGKILL)  # a worker leads a group of its own (_worker_main)
        except ProcessLookupError:  # gone already, or not yet in its own group
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


@contextlib.contextmanager
def _ctrl_c_passed_on(failure_dir: str) -> Iterator[_CtrlC]:
    """Install :class:`_CtrlC` for SIGINT for the block (main thread only), then restore the previous handler."""
    handler = _CtrlC(failure_dir)
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
def _signals_passed_on(names: tuple[str, ...], failure_dir: str) -> Iterator[None]:
    """For the block, pass each signal of ``names`` on to the workers instead of dying of it (main thread only).

    torch's agent does so itself (:data:`AGENT_SIGNALS`) when it runs in the
    main thread; with start_method "fork" it runs in a thread of its own,
    where Python cannot handle signals. Like Ctrl-C, a signal passed on
    leaves the marker that stops restarts: the job was asked to end.
    """

    def pass_on(signum: int, frame: Any) -> None:
        open(os.path.join(failure_dir, INTERRUPTED_MARKER), "w").close()
        for child in multiprocessing.active_children():
            with contextlib.suppress(ProcessLookupError):
                os.kill(child.pid, signum)

    previous = {}
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


def _in_a_thread_of_its_own(call: Callable[..., Any], *args: Any) -> Any:
    """Return ``call(*args)`` run in a new thread (or raise what it raised); the caller's thread waits for it.

    A forked worker is a copy of the thread that forked it. Where that thread
    has run a parallel torch operator, GNU OpenMP (torch's CPU thread pool)
    keeps a pool of threads for it, which a fork does not copy: the worker
    then hangs in its first parallel operator (tests/launchers/test_function.py
    shows it). The pool belongs to the thread, so a worker forked from a
    thread that never ran an operator (this one: torch's agent forks every
    worker, restarts included, from the thread that runs it) starts clean.
    The caller's thread keeps handling the signals meanwhile. A daemon: if
    the caller's thread ends (the interpreter exits), the workers, which die
    with the thread that forked them (:mod:`ddpkit.launchers.function`), go too.
    """
    outcome: dict[str, Any] = {}

    def target() -> None:
        try:
            outcome["result"] = call(*args)
        except BaseException as e:  # handed to the caller's thread
            outcome["error"] = e

    thread = threading.Thread(target=target, name="ddpkit-launch-agent", daemon=True)
    thread.start()
    thread.join()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["result"]


def _launch_config(spec: LaunchSpec) -> Any:
    """torch's LaunchConfig for ``spec``: one node's loopback rendezvous, or several nodes' static one."""
    from torch.distributed.launcher.api import LaunchConfig

    rendezvous = _static_rendezvous(spec) if spec.nnodes > 1 else _loopback_rendezvous(spec)
    return LaunchConfig(
        nproc_per_node=spec.nproc,
        max_restarts=spec.max_restarts,
        monitor_interval=spec.monitor_interval,
        start_method=spec.start_method,
        **rendezvous,
    )


def _loopback_rendezvous(spec: LaunchSpec) -> dict[str, Any]:
    """A job on this machine alone: the rendezvous on loopback, at a free port unless one is given."""
    from ddpkit.launchers import loopback

    if spec.master_port:
        check_port_free(spec.master_port)
    port = spec.master_port or free_port(LOOPBACK)
    loopback.register()
    return dict(
        min_nodes=1,
        max_nodes=1,
        run_id=f"ddpkit-{uuid.uuid4().hex[:12]}",
        rdzv_backend=loopback.BACKEND,
        rdzv_endpoint=f"{LOOPBACK}:{port}",
        local_addr=LOOPBACK,
    )


def _static_rendezvous(spec: LaunchSpec) -> dict[str, Any]:
    """This machine's part in a job of ``spec.nnodes``: a static rendezvous, node 0's store on one address."""
    from ddpkit.launchers import static
    from ddpkit.served_store import listen_address, warn_if_wildcard

    configs: dict[str, Any] = {"rank": spec.node_rank, "timeout": int(spec.rendezvous_timeout)}
    if spec.node_rank == 0:  # the store listens on the address node 0 reaches master_addr from, only
        configs["listen_address"] = listen_address(spec.master_addr, single_host=False)
        check_port_free(spec.master_port, configs["listen_address"])
        warn_if_wildcard(configs["listen_address"], spec.master_addr)
    static.register()
    return dict(
        min_nodes=spec.nnodes,
        max_nodes=spec.nnodes,
        run_id=f"ddpkit-{spec.master_addr}-{spec.master_port}",  # the same on every node
        rdzv_backend=static.BACKEND,
        rdzv_endpoint=f"{spec.master_addr}:{spec.master_port}",
        rdzv_configs=configs,
    )


@contextlib.contextmanager
def _output_to_files(spec: LaunchSpec, config: Any, failure_dir: str) -> Iterator[ConsoleTee | None]:
    """With ``spec.log_dir``: the workers' output into their files, the shown ranks' copied to the console.

    Yields the tee (None without a log_dir). When the block ends, the console has shown everything the
    workers wrote, and one line names the ranks not shown that wrote to stderr.
    """
    if not spec.log_dir:
        yield None
        return
    from ddpkit.launchers import output

    error_dir = os.path.join(failure_dir, "errors")  # torch's error files (a folder: _recorded_failures skips it)
    os.makedirs(error_dir)
    log_dir = output.new_log_dir(spec.log_dir)  # this launch's own: another's is never touched
    tee = output.ConsoleTee(spec.show_ranks, sys.stdout, sys.stderr)
    config.logs_specs = output.RankLogs(str(log_dir), error_dir, tee)
    print(f"ddpkit: {output.where(log_dir, spec.show_ranks)}", file=sys.stderr, flush=True)
    tee.start()
    try:
        yield tee
    finally:
        tee.stop()
        if note := output.hidden_stderr_note(tee):
            print(note, file=sys.stderr, flush=True)


def with_its_output(failure: WorkerFailure, tee: ConsoleTee) -> WorkerFailure:
    """``failure`` (of a launch whose output ``tee`` follows) naming the failed rank's files; a rank not shown that left no traceback: its stderr's last lines."""
    from ddpkit.launchers.output import last_lines

    files = tee.files_of(failure.rank)
    if files is None:  # not a rank of this node
        return failure
    stdout, stderr = files
    message, traceback = failure.message, failure.traceback
    if not tee.is_shown(failure.rank):  # its output is in its files, not above
        message = message.replace(" (see its output above)", "")
        if not traceback and (tail := last_lines(stderr)):
            traceback = f"the last lines of its stderr:\n{tail}"
    return dataclasses.replace(failure, message=message, traceback=traceback, output=f"{stdout}, {stderr}")


def launch_local(spec: LaunchSpec, fn: Callable[..., Any], *args: Any) -> dict[int, Any]:
    """Run ``fn(*args)`` in ``spec.nproc`` workers here (of ``spec.nnodes`` nodes); return their results by rank.

    With start_method "forkserver", ``fn`` must be picklable (a module-level
    function): workers are forked from the worker server, which receives
    ``fn`` and ``args`` pickled. With "fork", they are forked from this
    process, from a thread of the agent's own, and nothing is pickled.

    Raises:
        ValueError: nproc < 1 or the port is taken.
        LaunchError: a worker failed (after the allowed restarts).
        StoppedBySignal: the launcher received a signal it passes on (SIGTERM, SIGHUP, SIGQUIT,
            ``spec.forward_signals``); the workers were stopped with it.
    """
    from torch.distributed.launcher.api import LaunchConfig

    if spec.nproc < 1:
        raise UserError(f"nproc={spec.nproc} is not valid; it must be at least 1")
    config = _launch_config(spec)
    names = AGENT_SIGNALS + tuple(s for s in spec.forward_signals if s not in (*AGENT_SIGNALS, "SIGINT"))
    if "signals_to_handle" in {f.name for f in dataclasses.fields(LaunchConfig)}:
        # torch >= 2.7; older agents handle only their own list (SIGINT included: Ctrl-C then stops the
        # workers without a checkpoint).
        config.signals_to_handle = ",".join(names)
    forked = spec.start_method == "fork"  # the agent in a thread of its own: this thread passes the signals on
    _quiet_elastic_logs()
    _finish_workers_that_exit_without_returning()
    _announce_restarts()
    _host_outlives_the_exit_barrier()
    _exit_codes_at_shutdown()
    failed: list[tuple[WorkerFailure, Path]] = []  # added to their ranks' stderr files once the console showed them
    try:
        return _launch_recording_failures(spec, config, forked, names, failed, fn, *args)
    finally:
        for failure, stderr in failed:
            append_to_output(failure, stderr)


def _launch_recording_failures(
    spec: LaunchSpec,
    config: Any,
    forked: bool,
    names: tuple[str, ...],
    failed: list[tuple[WorkerFailure, Path]],
    fn: Callable[..., Any],
    *args: Any,
) -> dict[int, Any]:
    """:func:`launch_local`'s launch; each rank's recorded error and its stderr file are added to ``failed``."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    with (
        tempfile.TemporaryDirectory(prefix="ddpkit-failures-") as failure_dir,
        _output_to_files(spec, config, failure_dir) as tee,
    ):
        try:
            with (
                contextlib.nullcontext() if forked else worker_server(),
                _environ_restored(),
                _fresh_store_per_restart(),
                _environ(FAILURE_DIR_VARIABLE, failure_dir),
                _ctrl_c_passed_on(failure_dir) as ctrl_c,
                _signals_passed_on(names if forked else (), failure_dir),
            ):
                run = elastic_launch(config, _worker_main)
                if forked:
                    return _in_a_thread_of_its_own(run, os.getpid(), dict(os.environ), spec.title, fn, *args)
                return run(os.getpid(), dict(os.environ), spec.title, fn, *args)
        except ChildFailedError as e:
            failure = root_cause(e.failures, failure_dir)
            if ctrl_c.count and failure.exitcode != EXIT_INTERRUPTED:
                # Whatever a worker died of after Ctrl-C (e.g. the interrupt hit it while it was still
                # starting), the user asked the job to stop: report that, not a failure.
                failure = WorkerFailure(failure.rank, EXIT_INTERRUPTED, "interrupted (Ctrl-C)", "")
            elif tee is not None:
                failure = with_its_output(failure, tee)
                files = {f.rank: tee.files_of(f.rank) for f in recorded_failures(failure_dir)}
                failed += [(f, paths[1]) for f in recorded_failures(failure_dir) if (paths := files[f.rank])]
            raise LaunchError(failure) from None
        except SignalException as e:
            name = signal.Signals(e.sigval).name
            raise StoppedBySignal(name, getattr(e, "ddpkit_exit_codes", {})) from None
