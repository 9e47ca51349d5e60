"""What a single-node job exposes: listening sockets on loopback only, shared memory and checkpoints private.

Each job runs as a user runs it, in a process of its own; the test watches
the job's whole process tree (launcher, worker server, workers) with psutil
while it runs, and lists every listening TCP socket it opens. The address a
job of several nodes listens on is chosen here too (:mod:`ddpkit.served_store`),
and so is the one of a job whose launcher only sets MASTER_ADDR and the
ranks (srun, mpirun, a job script).
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

from ddpkit import served_store
from ddpkit.env.ports import free_port
from ddpkit.errors import UserError
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
    out, listening, _ = watch(["run", "nproc=2", "max_restarts=1", "show_ranks=all", "script.py"], tmp_path)
    assert out.returncode == 0, out.stderr
    assert "rank 0 restart 1 sum 4" in out.stdout and "rank 1 restart 1 sum 4" in out.stdout, out.stdout
    assert "Traceback" not in out.stdout + out.stderr, out.stderr
    assert len(listening) >= 3, listening
    assert {address for address, _ in listening} <= LOOPBACK, f"listening beyond loopback: {listening}"


def test_node_0_of_several_serves_the_store_on_the_address_it_reaches_the_master_from():
    # On several nodes (tests/cluster/test_multinode.py runs two), node 0's store listens on that address only.
    assert served_store.listen_address("127.0.0.1", single_host=False) == "127.0.0.1"
    assert served_store.listen_address("localhost", single_host=False) in LOOPBACK


def test_a_master_addr_node_0_cannot_resolve_is_one_line_naming_the_fix():
    with pytest.raises(UserError, match=r"^master_addr=no-such-host\.invalid does not resolve on .*; pass "):
        served_store.listen_address("no-such-host.invalid", single_host=False)


def test_a_host_name_that_is_loopback_on_node_0_only_keeps_the_store_reachable_and_says_so(monkeypatch):
    # Debian's /etc/hosts maps the host's own name to 127.0.1.1, while other hosts reach the name elsewhere.
    # The name's resolution here is the one thing replaced (this test does not edit /etc/hosts).
    name = "node0"
    resolve = served_store.source_address_for
    monkeypatch.setattr(served_store, "source_address_for", lambda addr: resolve("127.0.1.1" if addr == name else addr))
    assert served_store.listen_address(name, single_host=False) == served_store.WILDCARD
    assert served_store.listen_address(name, single_host=True).startswith("127.")  # a job on this host alone
    warning = served_store.wildcard_warning(name)
    assert "\n" not in warning and warning.startswith("ddpkit: warning: master_addr=node0 is a loopback address")
    assert "pass node 0's network address as master_addr" in warning


HAND_STARTED_SCRIPT = """
import time
import torch, torch.distributed as dist
import ddpkit
ctx = ddpkit.init(backend="gloo")
value = torch.ones(1)
dist.all_reduce(value)
time.sleep(1.5)  # long enough for the test to see the sockets
dist.all_reduce(value)
print(f"rank {ctx.rank} sum {value.item():g}", flush=True)
ddpkit.shutdown()
"""


def test_ranks_started_by_a_job_script_form_their_group_on_a_store_that_listens_on_loopback_only(tmp_path):
    # What srun and mpirun give (MASTER_ADDR and the ranks), here set by hand: rank 0 serves the group's store.
    (tmp_path / "script.py").write_text(HAND_STARTED_SCRIPT)
    port = free_port("127.0.0.1")
    procs = [
        subprocess.Popen(
            [sys.executable, "script.py"],
            cwd=tmp_path,
            env={
                **os.environ,
                "PYTHONPATH": PYTHONPATH,
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "RANK": str(rank),
                "WORLD_SIZE": "2",
                "LOCAL_RANK": str(rank),
                "LOCAL_WORLD_SIZE": "2",
            },
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for rank in range(2)
    ]
    listening: set[tuple[str, int]] = set()
    deadline = time.monotonic() + 120
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        for p in procs:
            listening |= _listening_of(p.pid)
        time.sleep(0.02)
    outs = []
    for p in procs:
        if p.poll() is None:
            p.kill()
        outs.append(p.communicate())
    for rank, (out, err) in enumerate(outs):
        assert f"rank {rank} sum 4" in out, err
    assert ("127.0.0.1", port) in listening, listening  # rank 0's store
    assert {address for address, _ in listening} <= LOOPBACK, f"listening beyond loopback: {listening}"


def _listening_of(pid: int) -> set[tuple[str, int]]:
    try:
        return _listening(psutil.Process(pid))
    except psutil.NoSuchProcess:
        return set()
