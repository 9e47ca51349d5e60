"""Elastic jobs on one machine: two launchers of ``nnodes=1:2`` on loopback, a node that joins or is lost.

    launcher A  ddpkit run|train nproc=1 nnodes=1:2 master_addr=127.0.0.1 master_port=P   (serves the store)
    launcher B  the same command, started later (a node joining) or SIGKILLed mid-epoch (a node lost)

Both launchers name their node 127.0.0.1, so the lines say "node 127.0.0.1 joined". The network namespaces of
tests/cluster/test_elastic.py add nothing to what these tests look at: the lines a user reads, the exit statuses.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ddpkit.env.ports import free_port
from tests.cluster.test_elastic import SCRIPT, finish, kill_node, wait_for_step
from tests.cluster.test_multinode import worker_environment

JOINING = "a node is joining this elastic job: the workers stopped after global step "
WAIT = 90.0
"""Seconds a test waits for one change of the job before it fails."""


def start_launcher(command: str, words: list[str], cwd: Path, env: dict[str, str]) -> subprocess.Popen[str]:
    """One node's launcher (``ddpkit run`` or ``ddpkit train``) of the elastic job, in a process group of its own."""
    return subprocess.Popen(
        [sys.executable, "-m", "ddpkit", command, "nproc=1", "nnodes=1:2", "master_addr=127.0.0.1", *words],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


@pytest.mark.timeout(240)
def test_a_node_that_joins_is_said_as_a_join_not_as_a_preemption(tmp_path):
    env = worker_environment(STEP_SLEEP="0.25", EPOCHS="6", OMP_NUM_THREADS="1")
    out = tmp_path / "out"
    words = [f"master_port={free_port()}", "rdzv_last_call=1", "rdzv_id=join-test", str(SCRIPT), str(out)]
    node_a = start_launcher("run", words, tmp_path, env)
    node_b = None
    try:
        alone = wait_for_step(out, 1, after=2)  # A trains alone, then B comes: the running workers are stopped
        node_b = start_launcher("run", words, tmp_path, env)
        wait_for_step(out, 2, after=alone)
        rc_a, err_a = finish(node_a, timeout=WAIT)
        rc_b, err_b = finish(node_b, timeout=WAIT)
    finally:
        for node in (node_a, node_b):
            if node is not None and node.poll() is None:
                os.killpg(node.pid, signal.SIGKILL)
    said = err_a + err_b
    assert (rc_a, rc_b) == (0, 0), said[-4000:]
    (line,) = [line for line in said.splitlines() if JOINING in line]
    assert "continues from it at its new size" in line, line
    assert "preempted by" not in said and "exiting with status" not in said, said[-4000:]
    assert said.count("node 127.0.0.1 joined; continuing on 2 nodes, 2 workers, from step ") == 1, said[-4000:]


def _wait_for_store(port: int) -> None:
    """Wait until the first launcher serves the rendezvous store at 127.0.0.1:``port``."""
    deadline = time.monotonic() + WAIT
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
            return
        time.sleep(0.1)
    raise AssertionError(f"no store at 127.0.0.1:{port} within {WAIT:g}s")


def _trained_by_two(folder: Path) -> bool:
    """Whether the run in ``folder`` has written a checkpoint at world size 2 (both nodes train)."""
    for manifest in (folder / "checkpoints").glob("step-*/manifest.json"):
        try:
            if json.loads(manifest.read_text())["world_size"] == 2:
                return True
        except (OSError, ValueError):  # pruned, or being written, as it was read
            pass
    return False


@pytest.mark.timeout(240)
def test_ddpkit_train_goes_on_alone_when_the_other_node_is_lost(tmp_path):
    env = worker_environment(OMP_NUM_THREADS="1")
    port = free_port()
    words = [f"master_port={port}", "rdzv_last_call=1", "rdzv_id=lost-test", "dataset=synthetic"]
    words += ["synthetic_samples=64000", "batch_size=16", "epochs=2", "progress=false", "threads=1"]
    words += ["checkpoint.every_steps=200"]  # each checkpoint stays a while (keep=2)
    # resume=auto: B's launcher may start once A has written checkpoints into the run folder both share (B would be
    # refused its folder without it, resume=never being the default).
    words += ["resume=auto"]
    nodes = [start_launcher("train", words, tmp_path, env)]
    folder = tmp_path / "runs" / "mlp-synthetic" / "elastic-lost-test"
    try:
        _wait_for_store(port)  # A serves the store: the node lost is B, which is its client
        nodes.append(start_launcher("train", words, tmp_path, env))
        deadline = time.monotonic() + WAIT
        while not _trained_by_two(folder) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _trained_by_two(folder), "no checkpoint of both nodes within the wait"
        kill_node(nodes[1])  # mid-epoch: B's launcher and worker, as a machine that dies
        lost_rc, _ = finish(nodes[1])
        rc, err = finish(nodes[0], timeout=150)
    finally:
        for node in nodes:
            if node.poll() is None:
                os.killpg(node.pid, signal.SIGKILL)
    assert lost_rc == -signal.SIGKILL
    assert rc == 0, err[-4000:]
    assert err.count("node 127.0.0.1 left; continuing on 1 nodes, 1 workers, from step ") == 1, err[-4000:]
    summary = json.loads((folder / "summary.json").read_text())
    assert summary["world_size"] == 1, summary


@pytest.mark.timeout(180)
def test_ddpkit_train_elastic_in_an_srun_task_is_the_nodes_launcher(tmp_path):
    # The variables srun sets in the one task per node of `ddpkit slurm nodes=1-2`'s script: SLURM_PROCID is the
    # task's, not a worker's rank; the launcher starts nproc workers, ranked by the rendezvous.
    task = dict(SLURM_JOB_ID="4242", SLURM_STEP_ID="0", SLURM_PROCID="0", SLURM_NTASKS="1", SLURM_LOCALID="0")
    task.update(SLURM_NODEID="0", SLURM_NNODES="1", SLURM_TASKS_PER_NODE="1", SLURM_JOB_NODELIST="localhost")
    env = worker_environment(OMP_NUM_THREADS="1", **task)
    words = [f"master_port={free_port()}", "rdzv_last_call=1", "dataset=synthetic", "synthetic_samples=512"]
    words += ["epochs=1", "progress=false", "threads=1"]
    launcher = subprocess.Popen(
        [sys.executable, "-m", "ddpkit", "train", "nproc=2", "nnodes=1:2", "master_addr=127.0.0.1", *words],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    rc, err = finish(launcher, timeout=150)
    assert rc == 0, err[-4000:]
    summary = json.loads((tmp_path / "runs" / "mlp-synthetic" / "slurm-4242" / "summary.json").read_text())
    assert summary["world_size"] == 2, summary
