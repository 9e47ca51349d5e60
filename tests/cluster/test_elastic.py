"""An elastic job (``ddpkit run nnodes=1:2``) on two hosts made of network namespaces, each node its own launcher.

    namespace A  10.77.0.1  ddpkit run nproc=1 nnodes=1:2 master_addr=10.77.0.1 ...   (serves the store)
    namespace B  10.77.0.2  ddpkit run nproc=1 nnodes=1:2 master_addr=10.77.0.1 ...

One job goes through every change a node can make, in turn: B's whole process group SIGKILLed mid-epoch (A
goes on alone), B started again (taken in: the job goes on at 2), B's launcher sent SIGTERM, a preemption
notice (the job checkpoints, B exits 75, A goes on alone). The user's loop (tests/launchers/scripts/
elastic_train.py) records which samples each rank trained at each step; counting only the history that
survived (a round that resumed from step S redoes the steps after S), every sample of every epoch is trained
exactly once. The loss of A, which serves the store, is one line on B and a non-zero exit.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from ddpkit.env.ports import free_port
from ddpkit.names import EXIT_PREEMPTED
from tests.cluster.test_multinode import TORCHRUN, worker_environment
from tests.helpers.netns import Host, TwoHosts, netns_hosts  # noqa: F401  (netns_hosts is a fixture)

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

SCRIPT = Path(__file__).parents[1] / "launchers" / "scripts" / "elastic_train.py"
NUM_SAMPLES, STEPS_PER_EPOCH = 64, 8
WAIT = 90.0
"""Seconds a test waits for one change of the job (a rendezvous, a restart) before it fails."""


def start_node(host: Host, master: Host, port: int, out: Path, env: dict[str, str]) -> subprocess.Popen[str]:
    """One node's launcher of the elastic job in ``host``, in a process group of its own."""
    argv = [sys.executable, "-m", "ddpkit", "run", "nproc=1", "nnodes=1:2", f"master_addr={master.address}"]
    argv += [f"master_port={port}", "rdzv_last_call=1", "rdzv_id=elastic-test", str(SCRIPT), str(out)]
    return subprocess.Popen(
        host.command(argv),
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def wait_for_step(out: Path, world_size: int, after: int = 0) -> int:
    """The first global step after ``after`` that rank 0 finished at ``world_size`` (waits up to WAIT seconds)."""
    deadline = time.monotonic() + WAIT
    while time.monotonic() < deadline:
        steps = [int(p.name.split("-")[1]) for p in out.glob(f"step-*-ws{world_size}")]
        if steps := [s for s in steps if s > after]:
            return min(steps)
        time.sleep(0.05)
    raise AssertionError(f"no step after {after} at world size {world_size} within {WAIT:g}s")


def kill_node(node: subprocess.Popen[str]) -> None:
    """SIGKILL a node's launcher and every process under it, as a machine that dies (torchrun's workers, and
    ddpkit's, run in process groups of their own)."""
    tree = [node.pid, *(child.pid for child in psutil.Process(node.pid).children(recursive=True))]
    for pid in tree:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def finish(node: subprocess.Popen[str], timeout: float = WAIT) -> tuple[int, str]:
    """The exit status and stderr of ``node`` once it ended (killed with its group when it outlives ``timeout``)."""
    try:
        _, stderr = node.communicate(timeout=timeout)
    finally:
        if node.poll() is None:
            os.killpg(node.pid, signal.SIGKILL)
            node.communicate()
    return node.returncode, stderr


def surviving_history(records_dir: Path) -> dict[int, list[dict]]:
    """Each global step's records from the last round that ran it: a round resumed from a checkpoint redoes the
    steps after it, so an earlier round's records of those steps are not part of the run."""
    rounds: dict[str, list[dict]] = collections.defaultdict(list)
    for path in records_dir.glob("*.jsonl"):
        for line in path.read_text().splitlines():
            record = json.loads(line)
            rounds[record["round"]].append(record)
    ordered = sorted(rounds.values(), key=lambda records: min(r["time"] for r in records))
    history: dict[int, list[dict]] = {}
    for records in ordered:
        by_step: dict[int, list[dict]] = collections.defaultdict(list)
        for record in records:
            assert record["step"] > record["start"], record  # a round starts after the step it resumed from
            by_step[record["step"]].append(record)
        history.update(by_step)
    return history


def assert_each_sample_once_per_epoch(history: dict[int, list[dict]], epochs: int) -> None:
    assert sorted(history) == list(range(1, epochs * STEPS_PER_EPOCH + 1))
    for step, records in history.items():
        assert len(records) == records[0]["world_size"], (step, records)  # every rank of that round trained it
    for epoch in range(epochs):
        indices = [i for step in history for r in history[step] if r["epoch"] == epoch for i in r["indices"]]
        assert sorted(indices) == list(range(NUM_SAMPLES)), (epoch, collections.Counter(indices).most_common(3))


@pytest.mark.timeout(420)
def test_a_node_lost_joined_and_preempted_the_job_goes_on(netns_hosts: TwoHosts, tmp_path):
    a, b = netns_hosts
    epochs = 8
    env = worker_environment(STEP_SLEEP="0.25", EPOCHS=str(epochs), OMP_NUM_THREADS="1")
    out, port = tmp_path / "out", free_port()
    node_a = start_node(a, a, port, out, env)
    node_b = start_node(b, a, port, out, env)
    try:
        killed_after = wait_for_step(out, 2, after=4)
        kill_node(node_b)  # B's launcher, its agent and its workers: the node is lost
        lost_rc, _ = finish(node_b)
        alone = wait_for_step(out, 1)
        node_b = start_node(b, a, port, out, env)  # B comes back: taken in at the next rendezvous
        again = wait_for_step(out, 2, after=alone)
        os.kill(node_b.pid, signal.SIGTERM)  # a preemption notice for B alone
        preempted_rc, preempted_err = finish(node_b)
        alone_again = wait_for_step(out, 1, after=again)
        rc_a, err_a = finish(node_a, timeout=240)
    finally:
        for node in (node_a, node_b):
            if node.poll() is None:
                os.killpg(node.pid, signal.SIGKILL)
    assert lost_rc == -signal.SIGKILL
    assert preempted_rc == EXIT_PREEMPTED, preempted_err[-3000:]
    assert rc_a == 0, err_a[-3000:]
    assert killed_after < again and alone < again < alone_again  # (the steps after the newest checkpoint are redone)
    said = err_a + preempted_err  # rank 0 speaks, on whichever node the rendezvous made it
    assert said.count(f"node {b.address} left; continuing on 1 nodes, 1 workers, from step ") == 2, said[-4000:]
    assert said.count(f"node {b.address} joined; continuing on 2 nodes, 2 workers, from step ") == 1, said[-4000:]
    # B's return stopped A's worker with SIGTERM, which is no preemption: the one preemption said is B's notice.
    assert said.count("a node is joining this elastic job: the workers stopped after global step ") == 1, said[-4000:]
    assert said.count("preempted by SIGTERM after global step ") == 1, said[-4000:]
    # After the notice the whole job checkpointed at one step, which A continued from without B.
    last_left = re.findall(
        rf"node {re.escape(b.address)} left; continuing on 1 nodes, 1 workers, from step (\d+)", said
    )[-1]
    assert f"step-{int(last_left):09d} (preempted)" in said, said[-4000:]

    assert_each_sample_once_per_epoch(surviving_history(out / "records"), epochs)
    final = json.loads((out / "final.json").read_text())
    alone_run = tmp_path / "alone"
    subprocess.run(
        [sys.executable, "-m", "ddpkit", "run", "nproc=1", str(SCRIPT), str(alone_run)],
        env={**env, "STEP_SLEEP": "0"},
        check=True,
        capture_output=True,
        timeout=120,
    )
    baseline = json.loads((alone_run / "final.json").read_text())
    assert abs(final["accuracy"] - baseline["accuracy"]) <= 0.05, (final, baseline)
    assert abs(final["loss"] - baseline["loss"]) <= 0.05, (final, baseline)


@pytest.mark.timeout(240)
def test_the_loss_of_the_stores_host_is_one_line_on_the_survivor(netns_hosts: TwoHosts, tmp_path):
    a, b = netns_hosts
    env = worker_environment(STEP_SLEEP="0.25", EPOCHS="8", OMP_NUM_THREADS="1")
    out, port = tmp_path / "out", free_port()
    node_a = start_node(a, a, port, out, env)
    node_b = start_node(b, a, port, out, env)
    try:
        wait_for_step(out, 2, after=2)
        kill_node(node_a)  # A served the rendezvous store
        rc_b, err_b = finish(node_b, timeout=WAIT)
    finally:
        for node in (node_a, node_b):
            if node.poll() is None:
                os.killpg(node.pid, signal.SIGKILL)
    assert rc_b != 0
    lines = [line for line in err_b.splitlines() if "rendezvous store" in line]
    assert lines == [
        f"error: the rendezvous store at {a.address}:{port} is gone (its host left the job or it was stopped), and "
        "an elastic job cannot go on without it; the workers here were stopped (resume from the newest checkpoint "
        "by running the same command again): serve the store on a machine that stays up, e.g. `ddpkit store "
        "port=P` on a login node, and point master_addr there"
    ], err_b[-3000:]


@pytest.mark.timeout(300)
def test_the_same_script_under_torchruns_elastic_flags(netns_hosts: TwoHosts, tmp_path):
    # torchrun's agents do not say which node went: the line counts the nodes instead.
    a, b = netns_hosts
    env = worker_environment(STEP_SLEEP="0.25", EPOCHS="3", OMP_NUM_THREADS="1")
    out, port = tmp_path / "out", free_port()
    nodes = []
    for host in (a, b):
        # torchrun's c10d form on these hosts (tests/cluster/test_multinode.py says why is_host and --local-addr)
        argv = [TORCHRUN, "--nnodes=1:2", "--nproc-per-node=1", "--max-restarts=1", "--rdzv-backend=c10d"]
        argv += [f"--rdzv-endpoint={a.address}:{port}", "--rdzv-id=torchrun-elastic", f"--local-addr={host.address}"]
        argv += [f"--rdzv-conf=is_host={'true' if host is a else 'false'},last_call_timeout=1"]
        nodes.append(
            subprocess.Popen(
                host.command([*argv, str(SCRIPT), str(out)]),
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                start_new_session=True,
            )
        )
    node_a, node_b = nodes
    try:
        wait_for_step(out, 2, after=4)
        kill_node(node_b)
        rc_a, err_a = finish(node_a, timeout=180)
    finally:
        for node in nodes:
            if node.poll() is None:
                os.killpg(node.pid, signal.SIGKILL)
    assert rc_a == 0, err_a[-3000:]
    assert err_a.count("1 node(s) left; continuing on 1 nodes, 1 workers, from step ") == 1, err_a[-3000:]
    assert_each_sample_once_per_epoch(surviving_history(out / "records"), 3)


@pytest.mark.timeout(300)
def test_ddpkit_train_elastic_nodes_share_one_run_folder(tmp_path):
    # Two launchers on loopback (namespaces add nothing here): the first serves the store, the second finds
    # its port taken and is its client. Both name the run folder alike, without node_rank.
    port = free_port()
    # rdzv_last_call's default, 30 s: the first node waits for the second (the round completes once both are in)
    words = ["nproc=1", "nnodes=1:2", "master_addr=127.0.0.1", f"master_port={port}"]
    words += ["rdzv_id=trainjob", "dataset=synthetic", "synthetic_samples=4096", "epochs=2", "progress=false"]
    env = {**worker_environment(), "OMP_NUM_THREADS": "1"}
    nodes = [
        subprocess.Popen(
            [sys.executable, "-m", "ddpkit", "train", *words, "threads=1"],
            cwd=tmp_path,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        for _ in range(2)
    ]
    results = [finish(node, timeout=240) for node in nodes]
    assert [rc for rc, _ in results] == [0, 0], results[0][1][-2000:] + results[1][1][-2000:]
    assert [p.name for p in (tmp_path / "runs" / "mlp-synthetic").iterdir()] == ["elastic-trainjob"]
    summary = json.loads((tmp_path / "runs" / "mlp-synthetic" / "elastic-trainjob" / "summary.json").read_text())
    assert summary["world_size"] == 2, summary


@pytest.mark.timeout(300)
def test_with_ddpkit_store_on_a_machine_that_stays_the_job_outlives_either_node(netns_hosts: TwoHosts, tmp_path):
    # The store served alone in host A (as on a login node); A's node finds the port taken and is its client,
    # so losing A's node leaves the store up and B goes on.
    a, b = netns_hosts
    env = worker_environment(STEP_SLEEP="0.25", EPOCHS="3", OMP_NUM_THREADS="1")
    out, port = tmp_path / "out", free_port()
    store = subprocess.Popen(
        a.command([sys.executable, "-m", "ddpkit", "store", f"port={port}", f"host={a.address}"]),
        env=env,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert store.stderr is not None and store.stderr.readline().startswith("ddpkit store: serving")
        node_a = start_node(a, a, port, out, env)
        node_b = start_node(b, a, port, out, env)
        try:
            wait_for_step(out, 2, after=2)
            kill_node(node_a)
            rc_b, err_b = finish(node_b, timeout=180)
        finally:
            for node in (node_a, node_b):
                if node.poll() is None:
                    os.killpg(node.pid, signal.SIGKILL)
    finally:
        store.terminate()
        store.wait(timeout=30)
    assert rc_b == 0, err_b[-3000:]
    assert err_b.count(f"node {a.address} left; continuing on 1 nodes, 1 workers, from step ") == 1, err_b[-3000:]
    assert_each_sample_once_per_epoch(surviving_history(out / "records"), 3)
