"""A run that succeeds after a restart prints no traceback and leaves no process it started.

tests/launchers/scripts/stuck_loader_worker.py: in the first round, rank 1's
DataLoader worker is inside a slow ``__getitem__`` (signals ignored, as in a
read from a stalled file system) when rank 1 is SIGKILLed; the restarted
round succeeds. The command runs in a process of its own, so that its exit
path (multiprocessing's finalizers, the launcher's temporary folders) is
the one a user sees. Every DataLoader worker of either round recorded its
pid: none may outlive the command.
"""

from __future__ import annotations

import psutil
import pytest

from tests.cli_runner import run_ddpkit
from tests.launchers.test_run import SCRIPTS


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.slow
def test_a_restarted_run_ends_without_traceback_or_leftover_processes(tmp_path):
    pids = tmp_path / "pids"
    pids.mkdir()
    out = run_ddpkit(
        "run",
        "nproc=2",
        "max_restarts=1",
        "show_ranks=all",
        str(SCRIPTS / "stuck_loader_worker.py"),
        str(pids),
        cwd=tmp_path,
        timeout=180,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "rank 1: my DataLoader worker is reading; sending myself SIGKILL" in out.stdout
    assert "restarting the workers (restart 1 of 1)" in out.stderr
    assert "rank 0: done" in out.stdout and "rank 1: done" in out.stdout
    assert "Traceback" not in out.stdout + out.stderr, out.stdout + out.stderr
    started = [int(name.split("-")[1]) for name in (path.name for path in pids.iterdir())]
    assert any(name.startswith("1-") for name in (path.name for path in pids.iterdir()))
    left = [pid for pid in started if _alive(pid)]
    for pid in left:  # not the test's children (reparented): the conftest guard would not see them
        psutil.Process(pid).kill()
    assert not left, f"DataLoader workers {left} outlived the command"
