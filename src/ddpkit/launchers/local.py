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
- workers forked from a warm process instead of spawned
  (:mod:`ddpkit.launchers.server`);
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

The worker server (:mod:`ddpkit.launchers.server`), the agent
(:mod:`ddpkit.launchers.agent`), the signals (:mod:`ddpkit.launchers.signals`)
and what each worker starts from (:mod:`ddpkit.launchers.worker_env`) live in
modules of their own; this one puts them together.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import socket
import sys
import tempfile
import threading
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

# torch is imported inside launch_local: `ddpkit train` starts the worker
# server (ddpkit.launchers.server) before this process imports torch itself.
from ddpkit.env.ports import free_port
from ddpkit.errors import UserError
from ddpkit.launchers.failure import (
    FAILURE_DIR_VARIABLE,
    LaunchError,
    WorkerFailure,
    append_to_output,
    recorded_failures,
    root_cause,
)
from ddpkit.launchers.server import worker_server
from ddpkit.launchers.signals import AGENT_SIGNALS, ctrl_c_passed_on, libc_prctl, signals_passed_on
from ddpkit.launchers.worker_env import environ_restored, environ_set, worker_main
from ddpkit.names import EXIT_INTERRUPTED, EXIT_PREEMPTED

if TYPE_CHECKING:
    from torch.distributed.launcher.api import LaunchConfig

    from ddpkit.launchers.console import ConsoleTee
    from ddpkit.launchers.output import RankOutput

LOOPBACK = "127.0.0.1"


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
    """Machines of the job, each running a launcher with its own node_rank; the fewest, when ``elastic``."""
    elastic: bool = False
    """Nodes may leave and join (torch's dynamic rendezvous, :mod:`ddpkit.launchers.elastic`) between
    ``nnodes`` and ``max_nodes``."""
    max_nodes: int = 0
    """With ``elastic``: the most nodes of the job."""
    rdzv_id: str = ""
    """With ``elastic``: the job's name in the rendezvous store (empty: $SLURM_JOB_ID, else from the endpoint)."""
    rdzv_last_call: float = 30.0
    """With ``elastic``: seconds a rendezvous waits for more nodes once ``nnodes`` are there."""
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


def _fresh_store_per_restart() -> contextlib.AbstractContextManager[None]:
    # torch's c10d rendezvous would share its own store with the workers across rounds, served on every
    # interface (pytorch/pytorch#135712: restarted workers then read the dead workers' gloo addresses).
    # Not shared, it only hands out an address, and ddpkit's loopback backend serves each round a new
    # store instead (read by the agent at each rendezvous, so set for the launch only).
    return environ_set("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")


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


def _launch_config(spec: LaunchSpec) -> LaunchConfig:
    """torch's LaunchConfig for ``spec``: one node's loopback rendezvous, several nodes' static one, or an
    elastic one."""
    from torch.distributed.launcher.api import LaunchConfig

    from ddpkit.launchers import elastic

    max_restarts = spec.max_restarts
    if spec.elastic:
        nodes = (spec.nnodes, spec.max_nodes)
        rendezvous = elastic.elastic_rendezvous(
            spec.master_addr, spec.master_port, nodes, spec.rdzv_id, spec.rdzv_last_call, spec.rendezvous_timeout
        )
        max_restarts = elastic.restarts(spec.max_restarts, *nodes)
    else:
        rendezvous = _static_rendezvous(spec) if spec.nnodes > 1 else _loopback_rendezvous(spec)
    return LaunchConfig(
        nproc_per_node=spec.nproc,
        max_restarts=max_restarts,
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
def _rank_files(spec: LaunchSpec, config: LaunchConfig, failure_dir: str) -> Iterator[RankOutput | None]:
    """With ``spec.log_dir``: this launch's rank files (:func:`ddpkit.launchers.output.rank_output`), given to
    torch's agent (their paths, and its error files in ``failure_dir``); None without a log_dir."""
    if not spec.log_dir:
        yield None
        return
    from ddpkit.launchers import output

    error_dir = os.path.join(failure_dir, "errors")  # torch's error files (a folder: _recorded_failures skips it)
    os.makedirs(error_dir)
    with output.rank_output(spec.log_dir, spec.show_ranks, sys.stdout, sys.stderr) as files:
        config.logs_specs = output.RankLogs(str(files.folder), error_dir, files.tee)
        yield files


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
    libc_prctl()  # resolved before any fork (ddpkit.launchers.signals)
    failed: list[tuple[WorkerFailure, Path]] = []  # added to their ranks' stderr files once the console showed them
    try:
        return _launch_recording_failures(spec, config, forked, names, failed, fn, *args)
    finally:
        for failure, stderr in failed:
            append_to_output(failure, stderr)


def _launch_recording_failures(
    spec: LaunchSpec,
    config: LaunchConfig,
    forked: bool,
    names: tuple[str, ...],
    failed: list[tuple[WorkerFailure, Path]],
    fn: Callable[..., Any],
    *args: Any,
) -> dict[int, Any]:
    """:func:`launch_local`'s launch; each rank's recorded error and its stderr file are added to ``failed``."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    from ddpkit.distributed import NODES_CHANGED_VARIABLE
    from ddpkit.launchers.agent import ddpkit_agent
    from ddpkit.launchers.torch_internals import SignalException

    with (
        tempfile.TemporaryDirectory(prefix="ddpkit-failures-") as failure_dir,
        _rank_files(spec, config, failure_dir) as rank_files,
    ):
        tee = rank_files.tee if rank_files is not None else None
        log_dir = str(rank_files.folder) if rank_files is not None else ""
        try:
            with (
                contextlib.nullcontext() if forked else worker_server(),
                environ_restored(),
                _fresh_store_per_restart(),
                environ_set(FAILURE_DIR_VARIABLE, failure_dir),
                (
                    environ_set(NODES_CHANGED_VARIABLE, os.path.join(failure_dir, "nodes-changed"))
                    if spec.elastic
                    else contextlib.nullcontext()
                ),
                ctrl_c_passed_on(failure_dir) as ctrl_c,
                signals_passed_on(names if forked else (), failure_dir),
                ddpkit_agent() as report,
            ):
                run = elastic_launch(config, worker_main)
                results: dict[int, Any]
                if forked:
                    results = _in_a_thread_of_its_own(
                        run, os.getpid(), dict(os.environ), spec.title, log_dir, fn, *args
                    )
                else:
                    results = run(os.getpid(), dict(os.environ), spec.title, log_dir, fn, *args)
                return results
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
            raise StoppedBySignal(name, report.exit_codes) from None
