"""What a single-node job exposes: listening sockets on loopback only, shared memory and checkpoints private.

Each job runs as a user runs it, in a process of its own; the test watches
the job's whole process tree (launcher, worker server, workers) with psutil
while it runs, and lists every listening TCP socket it opens. The address a
job of several nodes listens on is chosen here too (:mod:`ddpkit.launch.static`).
"""

from __future__ import annotations

import os
import re
import stat
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from ddpkit.errors import UserError
from ddpkit.launch import static
from tests.cli_runner import PYTHONPATH

LOOPBACK = {"127.0.0.1", "::1"}
RESTARTED_SCRIPT = """
import os, time
import torch, torch.distributed as dist
dist.init_process_group("gloo")
value = torch.ones(1)
dist.all_reduce(value)
time.sleep(1)  # long enough for the test to see the sockets
if os.environ["RANK"] == "1" and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
    os._exit(1)  # after the group formed: its keys are in the round's store
dist.all_reduce(value)
print(f"rank {dist.get_rank()} restart {os.environ['TORCHELASTIC_RESTART_COUNT']} sum {value.item():g}", flush=True)
dist.destroy_process_group()
"""


def watch(words: list[str], cwd: Path, timeout: float = 180) -> tuple[subprocess.CompletedProcess, set, dict]:
    """Run ``python -m ddpkit WORDS``; its result, the (address, port) of every listening socket of its process
    tree, and the modes of the shared-memory segments its processes mapped (path -> mode)."""
    env = {**os.environ, "PYTHONPATH": PYTHONPATH}
    proc = subprocess.Popen(
        [sys.executable, "-m", "ddpkit", *words],
        cwd=cwd,
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    listening: set[tuple[str, int]] = set()
    segments: dict[str, int] = {}
    deadline = time.monotonic() + timeout
    while proc.poll() is None and time.monotonic() < deadline:
        for process in _tree(proc.pid):
            listening |= _listening(process)
            segments.update(_shm_modes(process.pid))
        time.sleep(0.02)
    if proc.poll() is None:
        proc.kill()
    out, err = proc.communicate()
    return subprocess.CompletedProcess(words, proc.returncode, out, err), listening, segments


def _tree(pid: int) -> list[psutil.Process]:
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def _listening(process: psutil.Process) -> set[tuple[str, int]]:
    try:
        return {
            (c.laddr.ip, c.laddr.port) for c in process.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN
        }
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return set()


def _shm_modes(pid: int) -> dict[str, int]:
    """Modes of the /dev/shm files ``pid`` maps (read through /proc/PID/map_files: they may be unlinked already)."""
    modes = {}
    try:
        with open(f"/proc/{pid}/maps") as f:
            lines = f.read().splitlines()
        for line in lines:
            match = re.match(r"^([0-9a-f]+-[0-9a-f]+) .* (/dev/shm/\S+)", line)
            if match and "ddpkit" in match.group(2):
                modes[match.group(2)] = stat.S_IMODE(os.stat(f"/proc/{pid}/map_files/{match.group(1)}").st_mode)
    except OSError:  # the process ended meanwhile
        pass
    return modes


def test_ddpkit_train_listens_on_loopback_only_and_keeps_its_files_private(tmp_path):
    words = [
        "train",
        "nproc=2",
        "dataset=synthetic",
        "synthetic_samples=16384",
        "epochs=1",
        "threads=1",
        "progress=false",
        f"output_dir={tmp_path / 'run'}",
    ]
    out, listening, segments = watch(words, tmp_path)
    assert out.returncode == 0, out.stderr
    assert len(listening) >= 4, listening  # the launcher's two stores, each worker's gloo pair
    assert {address for address, _ in listening} <= LOOPBACK, f"listening beyond loopback: {listening}"
    assert segments and set(segments.values()) == {0o600}, segments  # the shared-memory all_reduce's
    files = [p for p in (tmp_path / "run" / "checkpoints").rglob("*") if p.is_file()]
    assert files and {stat.S_IMODE(p.stat().st_mode) for p in files} == {0o600}


def test_ddpkit_run_restart_of_a_plain_torch_script_listens_on_loopback_only(tmp_path):
    (tmp_path / "script.py").write_text(RESTARTED_SCRIPT)
    out, listening, _ = watch(["run", "nproc=2", "max_restarts=1", "script.py"], tmp_path)
    assert out.returncode == 0, out.stderr
    assert "rank 0 restart 1 sum 4" in out.stdout and "rank 1 restart 1 sum 4" in out.stdout, out.stdout
    assert "Traceback" not in out.stdout + out.stderr, out.stderr
    assert len(listening) >= 3, listening
    assert {address for address, _ in listening} <= LOOPBACK, f"listening beyond loopback: {listening}"


def test_node_0_of_several_serves_the_store_on_the_address_it_reaches_the_master_from():
    # On several nodes (tests/cluster/test_multinode.py runs two), node 0's store listens on that address only.
    assert static.listen_address("127.0.0.1") == "127.0.0.1"
    assert static.listen_address("localhost") in LOOPBACK


def test_a_master_addr_node_0_cannot_resolve_is_one_line_naming_the_fix():
    with pytest.raises(UserError, match=r"^master_addr=no-such-host\.invalid does not resolve on node 0 .*; pass "):
        static.listen_address("no-such-host.invalid")


def test_node_0_warns_in_one_line_when_its_store_would_listen_on_loopback_only():
    warning = static.loopback_warning("node0", "127.0.1.1")  # Debian's /etc/hosts entry for the host's own name
    assert warning is not None and "\n" not in warning
    assert warning.startswith("ddpkit: warning: master_addr=node0 is 127.0.1.1 on node 0, a loopback address")
    assert "pass node 0's network address as master_addr" in warning
    assert static.loopback_warning("node0", "10.77.0.1") is None
