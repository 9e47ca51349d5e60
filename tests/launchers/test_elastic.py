"""The parts of an elastic launch (``nnodes=MIN:MAX``) that need no second node: the words, the restarts, the
names of the nodes that changed, the line a resumed rank 0 says, and ``ddpkit store``.

Two nodes, lost, joined, preempted, and the store's host lost: tests/cluster/test_elastic.py.
"""

from __future__ import annotations

import re
import socket
import subprocess
import sys

import pytest

from ddpkit.distributed import NODES_CHANGED_VARIABLE, nodes_change_line
from ddpkit.env.ports import free_port
from ddpkit.keyvalue import ConfigError
from ddpkit.launchers.elastic import nodes_change, restarts, run_id
from ddpkit.launchers.options import Nodes, parse_nodes
from tests.cli_runner import PYTHONPATH


@pytest.mark.parametrize(
    "words,nodes",
    [("1", Nodes(1, 1, False)), ("4", Nodes(4, 4, False)), ("1:4", Nodes(1, 4, True)), ("2:2", Nodes(2, 2, True))],
)
def test_nnodes_is_n_or_min_max_as_torchruns(words, nodes):
    assert parse_nodes(words) == nodes


@pytest.mark.parametrize(
    "words,message",
    [
        ("0:2", "nnodes=0 is not valid; it must be > 0"),
        ("3:2", "nnodes=3:2 is not valid: MIN > MAX"),
        ("a:b", "nnodes=a:b is not valid; use nnodes=N (N nodes) or nnodes=MIN:MAX"),
        ("1:", "nnodes=1: is not valid; use nnodes=N"),
    ],
)
def test_other_nnodes_are_one_line(words, message):
    with pytest.raises(ConfigError, match=f"^{re.escape(message)}"):
        parse_nodes(words)


def test_an_elastic_launch_keeps_one_restart_in_hand_per_node_that_may_leave():
    assert restarts(0, 1, 3) == 2
    assert restarts(2, 2, 2) == 2


def test_the_run_id_is_the_given_one_else_the_slurm_job_else_the_endpoints():
    assert run_id("", "login1", 29500, {}) == "ddpkit-login1-29500"
    assert run_id("", "login1", 29500, {"SLURM_JOB_ID": "77"}) == "77"
    assert run_id("mine", "login1", 29500, {"SLURM_JOB_ID": "77"}) == "mine"


@pytest.mark.parametrize(
    "before,after,change",
    [
        (["a", "b"], ["a"], "node b left"),
        (["a"], ["b", "a"], "node b joined"),
        (["a", "b", "c"], ["a"], "nodes b, c left"),
        (["a", "b"], ["a", "c"], "node b left and node c joined"),
        (["h", "h"], ["h"], "node h left"),  # two nodes of one address (launchers on one machine)
        (["a", "b"], ["b", "a"], ""),  # the ranks changed, not the nodes
    ],
)
def test_the_nodes_that_changed_are_named(before, after, change):
    assert nodes_change(before, after) == change


def test_rank_0_says_in_one_line_who_left_how_many_remain_and_the_step(tmp_path):
    changed = tmp_path / "nodes-changed"
    changed.write_text("node 10.0.0.2 left")
    environ = {NODES_CHANGED_VARIABLE: str(changed), "GROUP_WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "2"}
    assert nodes_change_line(environ, 4, 2, 40) == (
        "node 10.0.0.2 left; continuing on 1 nodes, 2 workers, from step 40 (the same global batch and sample order)"
    )
    torchrun = {"GROUP_WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "2", "TORCHELASTIC_RESTART_COUNT": "1"}
    assert nodes_change_line(torchrun, 4, 2, 8).startswith("1 node(s) left; continuing on 1 nodes, 2 workers")
    # a job started again at another size, not a node lost: the detailed world size line says it
    assert nodes_change_line({**torchrun, "TORCHELASTIC_RESTART_COUNT": "0"}, 4, 2, 8) == ""
    changed.write_text("")
    assert nodes_change_line(environ, 4, 2, 8) == ""  # ddpkit's elastic launcher: no node changed
    assert nodes_change_line(environ, 2, 2, 40) == ""  # the same size: a restart, said otherwise
    assert nodes_change_line({}, 4, 2, 40) == ""  # not torchelastic's workers: the world size line says it


def _store(*words: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ddpkit", "store", *words],
        env={"PYTHONPATH": PYTHONPATH},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_ddpkit_store_needs_a_port():
    result = _store()
    assert result.returncode == 2
    assert result.stderr == (
        "error: port=0 is not valid; pass the TCP port the nodes give as master_port (e.g. port=29500)\n"
    )


def test_ddpkit_store_on_a_taken_port_is_one_line():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = _store(f"port={port}", "host=127.0.0.1")
    assert result.returncode == 2
    assert result.stderr == (
        f"error: cannot serve on 127.0.0.1:{port} (Address already in use); choose another port, or stop what "
        "serves it\n"
    )


def test_ddpkit_store_serves_until_sigterm():
    port = free_port()
    store = subprocess.Popen(
        [sys.executable, "-m", "ddpkit", "store", f"port={port}", "host=127.0.0.1"],
        env={"PYTHONPATH": PYTHONPATH},
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert store.stderr is not None
        first = store.stderr.readline()
        assert first.startswith(f"ddpkit store: serving the rendezvous store on 127.0.0.1:{port}; start each node")
        from torch.distributed import TCPStore

        client = TCPStore("127.0.0.1", port, None, False)
        client.set("k", "v")
        assert client.get("k") == b"v"
        store.terminate()
        assert store.wait(timeout=30) == 0
        assert store.stderr.read() == "ddpkit store: stopped by SIGTERM\n"
    finally:
        store.kill()


def test_a_node_joining_is_no_preemption_and_requeues_nothing(tmp_path, monkeypatch, caplog):
    from ddpkit.checkpoint.manager.preemption import say_preempted
    from ddpkit.distributed import NODES_JOINING

    changed = tmp_path / "nodes-changed"
    changed.write_text(NODES_JOINING)  # what the agent writes before it stops the workers for a node that joins
    monkeypatch.setenv(NODES_CHANGED_VARIABLE, str(changed))
    say_preempted("SIGTERM", 12, "ckpt/step-000000012", "run the same command again", True, {})
    (line,) = caplog.messages  # the line, and no requeue (which would end every node's part of the job)
    assert line.startswith("a node is joining this elastic job: the workers stopped after global step 12 with "), line
