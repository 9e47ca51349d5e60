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

import logging
import socket
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from ddpkit.env.ports import free_port
from ddpkit.launch.failure import LaunchError, root_cause, run_reporting_failure

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


def check_port_free(port: int, host: str = LOOPBACK) -> None:
    """Raise ValueError if ``port`` cannot be bound on ``host``."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            raise ValueError(f"master_port={port} is already in use on {host}; choose another port or master_port=0") from None


def _quiet_elastic_logs() -> None:
    # The agent logs every lifecycle step, and each failure with a traceback of
    # its own polling code; ddpkit reports the root cause itself.
    prefixes = ("torch.distributed.elastic", "torch.distributed.launcher", "torch.multiprocessing")
    for name in [*prefixes, *logging.root.manager.loggerDict]:
        if name.startswith(prefixes):
            logging.getLogger(name).setLevel(logging.CRITICAL)


def launch_local(spec: LaunchSpec, fn: Callable[..., Any], *args: Any) -> dict[int, Any]:
    """Run ``fn(*args)`` in ``spec.nproc`` workers; return their results by rank.

    ``fn`` must be picklable (a module-level function): workers are spawned.

    Raises:
        ValueError: nproc < 1 or the port is taken.
        LaunchError: a worker failed (after the allowed restarts).
    """
    if spec.nproc < 1:
        raise ValueError(f"nproc={spec.nproc} is not valid; it must be at least 1")
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
    _quiet_elastic_logs()
    try:
        return elastic_launch(config, run_reporting_failure)(fn, *args)
    except ChildFailedError as e:
        raise LaunchError(root_cause(e.failures)) from None
