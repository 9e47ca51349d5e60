"""The launcher leaves nothing behind: killed, interrupted twice, or refused, on every launch path.

Each test runs a small real program under ``ddpkit run``, ``ddpkit train`` or ``ddpkit.launch`` in a process of
its own (tests/traps/scripts/launcher_*.py), as a user would, and looks at the processes and files it leaves.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.cli_runner import PYTHONPATH, run_ddpkit
from tests.launchers.test_function import _gone, _kill

SCRIPTS = Path(__file__).parent / "scripts"
START_TIMEOUT = 120.0
"""Seconds a launch may take to have every worker training (torch imported twice on 2 busy cores)."""
GONE_WITHIN = 5.0
"""Seconds a run's processes may outlive their launcher's death."""
TINY_TRAIN = ["dataset=synthetic", "synthetic_samples=100000", "batch_size=8", "epochs=50", "progress=false"]


def _launcher(path: str, folder: Path) -> list[str]:
    """The command line of each launch path, running launcher_forever.py's loop into ``folder``."""
    script = str(SCRIPTS / "launcher_forever.py")
    launch = (
        "import sys, ddpkit; from tests.traps.scripts.launcher_forever import train; "
        "ddpkit.launch(train, sys.argv[1], nproc=2, start_method=sys.argv[2])"
    )
    return {
        "run": [sys.executable, "-m", "ddpkit", "run", "nproc=2", script, str(folder)],
        "train": [sys.executable, "-m", "ddpkit", "train", "nproc=2", *TINY_TRAIN, "output_dir=out"],
        "launch-forkserver": [sys.executable, "-c", launch, str(folder), "forkserver"],
        "launch-fork": [sys.executable, "-c", launch, str(folder), "fork"],
    }[path]


def _start(command: list[str], cwd: Path) -> subprocess.Popen[bytes]:
    environ = {**os.environ, "PYTHONPATH": PYTHONPATH}
    return subprocess.Popen(command, cwd=cwd, env=environ, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def _workers(launcher: psutil.Process) -> list[psutil.Process]:
    """The launcher's descendants that are ddpkit workers (titled ``ddpkit rank r/w: ...``, or forked by it)."""
    found = []
    for process in launcher.children(recursive=True):
        try:
            if process.cmdline()[:2] == ["ddpkit", "rank"] or " ".join(process.cmdline()).startswith("ddpkit rank"):
                found.append(process)
        except psutil.NoSuchProcess:
            pass
    return found


def _wait_until(ready: callable, process: subprocess.Popen[bytes], what: str) -> None:
    deadline = time.monotonic() + START_TIMEOUT
    while not ready():
        if process.poll() is not None:
            raise AssertionError(f"the launcher ended before {what}: {process.stderr.read().decode()}")
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} within {START_TIMEOUT} s")
        time.sleep(0.1)


@pytest.mark.parametrize("path", ["run", "train", "launch-forkserver", "launch-fork"])
def test_no_process_of_a_run_outlives_its_launcher_killed_with_sigkill(tmp_path, path):
    process = _start(_launcher(path, tmp_path), tmp_path)
    launcher = psutil.Process(process.pid)
    left: list[int] = []
    try:
        if path == "train":  # the built-in trainer's workers are titled by ddpkit
            _wait_until(lambda: len(_workers(launcher)) == 2, process, "2 workers")
        else:
            _wait_until(lambda: len(list(tmp_path.glob("ready-*"))) == 2, process, "2 workers training")
        started = [child.pid for child in launcher.children(recursive=True)]
        assert len(started) >= 2
        process.kill()  # as the OOM killer, or a kill -9 by hand
        process.wait()
        left = _gone(started, within=GONE_WITHIN)
        names = {pid: " ".join(psutil.Process(pid).cmdline())[:80] for pid in left if psutil.pid_exists(pid)}
        assert not left, f"{path}: {len(left)} processes outlived the killed launcher by {GONE_WITHIN} s: {names}"
    finally:
        process.kill()
        process.wait()
        _kill(left)


def test_a_second_ctrl_c_ends_workers_stuck_in_a_collective_within_seconds(tmp_path):
    command = [sys.executable, "-m", "ddpkit", "run", "nproc=2", str(SCRIPTS / "launcher_stuck.py"), str(tmp_path)]
    process = _start(command, tmp_path)
    started: list[int] = []
    try:
        _wait_until(lambda: len(list(tmp_path.glob("ready-*"))) == 2, process, "2 workers stuck")
        started = [child.pid for child in psutil.Process(process.pid).children(recursive=True)]
        time.sleep(0.5)  # both inside their collective
        process.send_signal(signal.SIGINT)  # Ctrl-C: the stuck workers cannot act on it
        time.sleep(1.0)
        process.send_signal(signal.SIGINT)  # Ctrl-C again: "stopping the workers now"
        try:
            status = process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            raise AssertionError("the launcher still waits for its stuck workers 15 s after a second Ctrl-C") from None
        stderr = process.stderr.read().decode()
        assert "ddpkit: Ctrl-C again: stopping the workers now" in stderr, stderr
        assert status == 130, stderr
        assert _gone(started, within=GONE_WITHIN) == []
    finally:
        process.kill()
        process.wait()
        _kill(started)


def test_a_second_run_into_a_live_runs_log_folder_touches_none_of_its_files(tmp_path):
    logs = tmp_path / "logs"
    live_command = [sys.executable, "-m", "ddpkit", "run", "nproc=2", f"log_dir={logs}"]
    live = _start([*live_command, str(SCRIPTS / "launcher_forever.py"), str(tmp_path)], tmp_path)
    started: list[int] = []
    try:
        _wait_until(lambda: len(list(tmp_path.glob("ready-*"))) == 2, live, "2 workers training")
        started = [child.pid for child in psutil.Process(live.pid).children(recursive=True)]
        # The second run asks for the same folder (as two runs into one output_dir started in the same second
        # do) and is refused at once.
        second = run_ddpkit(
            "run", "nproc=2", f"log_dir={logs}", str(SCRIPTS / "launcher_refused.py"), cwd=tmp_path, timeout=120
        )
        assert second.returncode == 2, second.stderr
        assert f"each rank's whole output is in {logs}-2" in second.stderr, second.stderr
        assert "refused: this folder is another run's" in (tmp_path / "logs-2" / "rank-0.stderr.log").read_text()
        time.sleep(1.5)  # the live run prints on
        for rank in (0, 1):
            lines = (logs / f"rank-{rank}.stdout.log").read_text().splitlines()
            assert lines and lines[0].startswith(f"rank {rank} step 0 loss"), lines
            assert len(lines) >= 2 and lines[-1].startswith(f"rank {rank} step "), lines
    finally:
        live.kill()
        live.wait()
        _kill(started)


def test_the_files_named_as_a_failed_ranks_whole_output_hold_its_traceback(tmp_path):
    out = run_ddpkit("run", "nproc=2", str(SCRIPTS / "launcher_fails.py"), cwd=tmp_path, timeout=120)
    assert out.returncode == 1, out.stderr
    report = out.stderr[out.stderr.index("error: worker rank 1 failed") :].splitlines()
    assert report[0] == "error: worker rank 1 failed (exit code 1): KeyError: 'rank 1 has no labels'", out.stderr
    # The report's frames are the script's, from its first line on, not the launcher's (run_script, runpy).
    assert report[1] == "Traceback (most recent call last):"
    assert report[2].endswith('launcher_fails.py", line 18, in <module>'), report
    assert report[4].endswith('launcher_fails.py", line 11, in labels_for'), report
    assert report[6] == "KeyError: 'rank 1 has no labels'"
    named = report[7].removeprefix("ddpkit: rank 1's whole output: ").split(", ")
    stdout, stderr = (Path(path).read_text() for path in named)
    assert stdout == "rank 1 starts\n"
    assert stderr.splitlines() == report[1:7]
    assert out.stderr.count("Traceback (most recent call last):") == 1  # one report, not one per rank
