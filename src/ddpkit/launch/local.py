"""Starting N workers on this machine through torch's elastic launcher.

``launch_local`` is ``torchrun --standalone --nproc-per-node N`` as a
function: torch's elastic agent starts the workers, supervises them, stops
them all when one fails, and restarts the group up to ``max_restarts`` times.
ddpkit adds what the command lacks:

- a rendezvous on loopback (``127.0.0.1``) at a free port asked from the OS
  (or the one given, checked first), so nothing listens on the network;
- one report of the root-cause failure (:mod:`ddpkit.launch.failure`)
  instead of every worker's traceback.

Pipeline: LaunchSpec -> LaunchConfig (torch) -> elastic_launch -> results
by rank, or LaunchError carrying the root cause.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import multiprocessing
import os
import signal
import socket
import sys
import tempfile
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from ddpkit.env.ports import free_port
from ddpkit.errors import UserError
from ddpkit.launch.failure import (
    FAILURE_DIR_VARIABLE,
    LaunchError,
    WorkerFailure,
    root_cause,
    run_reporting_failure,
)

LOOPBACK = "127.0.0.1"
AGENT_SIGNALS = ("SIGTERM", "SIGHUP", "SIGQUIT")
"""Signals torch's elastic agent handles (it also would SIGINT, which ddpkit's launcher handles itself):
passed on to the workers, which are then stopped."""
EXIT_INTERRUPTED = 130
"""A worker's exit status after Ctrl-C (128 + SIGINT)."""
INTERRUPTED_MARKER = "interrupted"
"""File in the launcher's failure folder once Ctrl-C was pressed: workers started after it (a restart) stop."""


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


def check_port_free(port: int, host: str = LOOPBACK) -> None:
    """Raise ValueError if ``port`` cannot be bound on ``host``."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            raise UserError(f"master_port={port} is already in use on {host}; choose another port or master_port=0") from None


def _quiet_elastic_logs() -> None:
    # The agent logs every lifecycle step, and each failure with a traceback of
    # its own polling code; ddpkit reports the root cause itself.
    prefixes = ("torch.distributed.elastic", "torch.distributed.launcher", "torch.multiprocessing")
    for name in [*prefixes, *logging.root.manager.loggerDict]:
        if name.startswith(prefixes):
            logging.getLogger(name).setLevel(logging.CRITICAL)


def _fresh_store_per_restart(max_restarts: int) -> contextlib.AbstractContextManager:
    # torch's c10d rendezvous shares one TCPStore, hosted by the agent, across
    # restarts: restarted workers can read the dead workers' gloo addresses
    # left in it and fail to connect (pytorch/pytorch#135712). With restarts,
    # rank 0 of each round hosts a new store instead (read by the agent at
    # each rendezvous, so set for the launch only).
    if not max_restarts:
        return contextlib.nullcontext()
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


def _worker_main(fn: Callable[..., Any], *args: Any) -> Any:
    """A spawned worker: its own process group, the platform's default start method back, then ``fn``.

    In a process group of its own, the worker does not get the terminal's
    Ctrl-C: the launcher passes on one SIGINT per Ctrl-C (see
    :class:`_CtrlC`), so a worker can tell the first (checkpoint and stop)
    from the second (stop now). The agent spawns its workers, and a spawned
    process inherits "spawn" as its own default; a DataLoader's workers would
    then re-import torch and the user's script each, where under ``python
    script.py`` or torchrun they are forked. ``fn`` runs with one failure
    report (:func:`run_reporting_failure`); a KeyboardInterrupt ends the
    worker with status 130 and no traceback.
    """
    os.setpgrp()
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


class _CtrlC:
    """The launcher's SIGINT handler: each Ctrl-C is passed on to the workers once.

    The workers take the first as a preemption (finish the step, checkpoint,
    exit 130) and the second as "stop now". The first also leaves a marker,
    so that the agent's restarts (``max_restarts``) start nothing more.
    """

    def __init__(self, failure_dir: str):
        self.failure_dir = failure_dir
        self.count = 0
        """Ctrl-C presses so far."""

    def __call__(self, signum: int, frame: Any) -> None:
        self.count += 1
        if self.count == 1:
            open(os.path.join(self.failure_dir, INTERRUPTED_MARKER), "w").close()
            print("\nddpkit: Ctrl-C: the workers finish their step, write a checkpoint and stop "
                  "(Ctrl-C again to stop at once)", file=sys.stderr, flush=True)
        elif self.count == 2:
            print("ddpkit: Ctrl-C again: stopping the workers now", file=sys.stderr, flush=True)
        for child in multiprocessing.active_children():  # the agent's workers
            with contextlib.suppress(ProcessLookupError):
                os.kill(child.pid, signal.SIGINT)


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


def launch_local(spec: LaunchSpec, fn: Callable[..., Any], *args: Any) -> dict[int, Any]:
    """Run ``fn(*args)`` in ``spec.nproc`` workers; return their results by rank.

    ``fn`` must be picklable (a module-level function): workers are spawned.

    Raises:
        ValueError: nproc < 1 or the port is taken.
        LaunchError: a worker failed (after the allowed restarts).
    """
    if spec.nproc < 1:
        raise UserError(f"nproc={spec.nproc} is not valid; it must be at least 1")
    if spec.master_port:
        check_port_free(spec.master_port)
    port = spec.master_port or free_port(LOOPBACK)
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=spec.nproc,
        run_id=f"ddpkit-{uuid.uuid4().hex[:12]}",
        rdzv_backend="c10d",
        rdzv_endpoint=f"{LOOPBACK}:{port}",
        rdzv_configs={"is_host": True},
        local_addr=LOOPBACK,
        max_restarts=spec.max_restarts,
        monitor_interval=spec.monitor_interval,
        start_method="spawn",
    )
    if "signals_to_handle" in {f.name for f in dataclasses.fields(LaunchConfig)}:
        # torch >= 2.7; older agents handle only their own list (SIGINT included: Ctrl-C then stops the
        # workers without a checkpoint).
        names = AGENT_SIGNALS + tuple(s for s in spec.forward_signals if s not in (*AGENT_SIGNALS, "SIGINT"))
        config.signals_to_handle = ",".join(names)
    _quiet_elastic_logs()
    with tempfile.TemporaryDirectory(prefix="ddpkit-failures-") as failure_dir:
        try:
            with _fresh_store_per_restart(spec.max_restarts), _environ(FAILURE_DIR_VARIABLE, failure_dir), \
                    _ctrl_c_passed_on(failure_dir) as ctrl_c:
                return elastic_launch(config, _worker_main)(fn, *args)
        except ChildFailedError as e:
            failure = root_cause(e.failures, failure_dir)
            if ctrl_c.count and failure.exitcode != EXIT_INTERRUPTED:
                # Whatever a worker died of after Ctrl-C (e.g. the interrupt hit it while it was still
                # starting), the user asked the job to stop: report that, not a failure.
                failure = WorkerFailure(failure.rank, EXIT_INTERRUPTED, "interrupted (Ctrl-C)", "")
            raise LaunchError(failure) from None
