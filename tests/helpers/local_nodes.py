"""Two "nodes" on this machine: ``ddpkit run nproc=1 nnodes=2 node_rank=R`` started twice, one per node_rank."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from ddpkit.env.ports import free_port
from tests.cli_runner import PYTHONPATH
from tests.helpers.launch_in_process import LAUNCHER_VARIABLES


def run_two_local_nodes(
    script: Path,
    *args: str,
    cwd: Path,
    env: dict[str, str] | None = None,
    stop_node_0: bool = False,
    timeout: float = 150,
) -> list[subprocess.CompletedProcess[str]]:
    """Run ``script`` with ``args`` as a job of two local nodes of one worker each; both results, once both ended.

    Args:
        script: the training script each node's launcher starts.
        cwd: the folder both launchers run in.
        env: variables added to this process's environment (less the launchers' own variables).
        stop_node_0: once node 1's launcher has ended, send SIGTERM to node 0's, as a scheduler ends a job whose
            other node failed (node 0's worker otherwise waits for the dead peer).
        timeout: seconds each launcher may take; both are killed when it passes.
    """
    environ = {k: v for k, v in os.environ.items() if not k.startswith(LAUNCHER_VARIABLES)}
    environ.update(PYTHONPATH=PYTHONPATH, **(env or {}))
    port = free_port()
    nodes = [
        subprocess.Popen(
            [sys.executable, "-m", "ddpkit", "run", "nproc=1", "nnodes=2", f"node_rank={rank}"]
            + ["master_addr=127.0.0.1", f"master_port={port}", str(script), *args],
            cwd=cwd,
            env=environ,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in (0, 1)
    ]
    try:
        if stop_node_0:
            nodes[1].wait(timeout=timeout)
            nodes[0].send_signal(signal.SIGTERM)
        outputs = [node.communicate(timeout=timeout) for node in nodes]
    finally:
        for node in nodes:
            node.kill()
    return [subprocess.CompletedProcess(node.args, node.returncode, *output) for node, output in zip(nodes, outputs)]
