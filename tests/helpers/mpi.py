"""OpenMPI's mpirun for tests: the command line, and running it with a hard timeout.

Tests run as root on 2 cores, so every command has ``--allow-run-as-root``
(OpenMPI refuses root otherwise) and ``--oversubscribe`` (more ranks than
cores), and ``--bind-to none`` (OpenMPI would pin each rank, and torch's
threads with it, to one core). Needs Debian's openmpi-bin:
scripts/cluster-setup.sh.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from collections.abc import Mapping, Sequence

SETUP_HINT = "run scripts/cluster-setup.sh (as root) to install openmpi-bin"


def mpirun_command(
    num_processes: int,
    command: Sequence[str],
    *,
    hostfile: str | None = None,
    export: Sequence[str] = (),
) -> list[str]:
    """The argv of ``mpirun`` starting command as num_processes ranks.

    Args:
        num_processes: Ranks to start (-np).
        command: What each rank runs, e.g. [sys.executable, "-m", "ddpkit", "train"].
        hostfile: An OpenMPI hostfile; None runs every rank on this host.
        export: Variables mpirun passes on to the ranks with -x (NAME or NAME=VALUE).

    Returns:
        The command line, ready for subprocess.

    Raises:
        ValueError: num_processes < 1 or command is empty.
    """
    if num_processes < 1:
        raise ValueError(f"num_processes={num_processes} must be >= 1")
    if not command:
        raise ValueError("command is empty; give the program each rank runs")
    argv = ["mpirun", "--allow-run-as-root", "--oversubscribe", "--bind-to", "none", "-np", str(num_processes)]
    if hostfile is not None:
        argv += ["--hostfile", hostfile]
    for name in export:
        argv += ["-x", name]
    return argv + list(command)


def run_mpirun(
    num_processes: int,
    command: Sequence[str],
    *,
    timeout: float = 60.0,
    env: Mapping[str, str] | None = None,
    **kwargs,
) -> subprocess.CompletedProcess:
    """Run command as num_processes ranks and wait; text output is captured.

    Args:
        num_processes: Ranks to start.
        command: What each rank runs.
        timeout: Seconds before mpirun (and with it every rank) is killed and
            subprocess.TimeoutExpired raised.
        env: Environment of mpirun and so of every rank; None inherits this one.
        **kwargs: Passed to mpirun_command (hostfile=, export=).

    Raises:
        FileNotFoundError: mpirun is not installed; the message says how to install it.
    """
    if shutil.which("mpirun") is None:
        raise FileNotFoundError(f"mpirun not found: {SETUP_HINT}")
    argv = mpirun_command(num_processes, command, **kwargs)
    # A session of its own: on timeout the whole group goes, ranks included
    # (killing mpirun alone with SIGKILL would orphan them).
    with subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=None if env is None else dict(env),
        start_new_session=True,
    ) as proc:
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            stdout, stderr = proc.communicate()
            raise subprocess.TimeoutExpired(argv, timeout, stdout, stderr) from None
    return subprocess.CompletedProcess(argv, proc.returncode, stdout, stderr)
