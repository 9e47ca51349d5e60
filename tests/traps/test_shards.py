"""Node-sharded data on two local "nodes": every sample once per epoch, exact resume, and the one-line refusals.

Each test launches ``ddpkit run nproc=1 nnodes=2 node_rank=R`` twice on this machine, each node with its own
shard folder staged from one data set (tests/traps/scripts/shards_train.py is the user's script).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ddpkit.data.node_shards import stage_node_shards, write_shards
from tests.cli_runner import PYTHONPATH
from tests.helpers.launch_in_process import LAUNCHER_VARIABLES
from tests.helpers.local_nodes import run_two_local_nodes

SCRIPT = Path(__file__).resolve().parent / "scripts" / "shards_train.py"
NUM_SAMPLES, NUM_SHARDS = 46, 5
"""Shards of 10, 9, 9, 9, 9 samples: node 0 holds 0,2,4 (28 samples, 7 steps), node 1 holds 1,3 (18, 5 steps)."""


def _data_set(root: Path) -> Path:
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(NUM_SAMPLES, 8, generator=generator)
    write_shards([torch.arange(NUM_SAMPLES), x, x[:, :3].sum(1)], root / "all", NUM_SHARDS)
    for node in (0, 1):
        stage_node_shards(root / "all", root / f"node-{node}", node=node, nodes=2)
    return root


def _two_nodes(
    cwd: Path, *args: str, env: dict[str, str] | None = None, stop_node_0: bool = False
) -> list[subprocess.CompletedProcess[str]]:
    """The training script as a job of two local nodes (see :func:`run_two_local_nodes`)."""
    return run_two_local_nodes(SCRIPT, *args, cwd=cwd, env=env, stop_node_0=stop_node_0)


def _ok(done: list[subprocess.CompletedProcess[str]]) -> None:
    assert [d.returncode for d in done] == [0, 0], done[0].stderr[-3000:] + done[1].stderr[-3000:]


@pytest.mark.timeout(300)
def test_an_epoch_covers_every_sample_once_and_a_killed_run_resumes_to_the_same_weights(tmp_path):
    data = _data_set(tmp_path)
    staged, stage = str(data / "staged-{node}"), {"STAGE_FROM": str(data / "all")}
    _ok(_two_nodes(tmp_path, staged, "plain", "plain.pt", "records", env=stage))
    assert sorted(p.name for p in (data / "staged-1").iterdir()) == [
        "manifest.json",
        "shard-00001.pt",
        "shard-00003.pt",
    ]
    for epoch in (0, 1):
        seen = [
            sorted(
                int(line.split()[1])
                for line in (tmp_path / f"records-rank{r}.txt").read_text().splitlines()
                if line.split()[0] == str(epoch)
            )
            for r in (0, 1)
        ]
        assert sorted(seen[0] + seen[1]) == list(range(NUM_SAMPLES))
        # Node 0 holds shards 0, 2, 4 (samples 0-9, 19-27, 37-45), node 1 shards 1, 3.
        assert set(seen[1]) == set(range(10, 19)) | set(range(28, 37))

    killed = _two_nodes(tmp_path, staged, "ckpt", "resumed.pt", env={"KILL_AT_STEP": "9", **stage}, stop_node_0=True)
    assert killed[1].returncode != 0 and "worker rank 1 failed (exit code -9)" in killed[1].stderr
    resumed_run = _two_nodes(tmp_path, staged, "ckpt", "resumed.pt", env=stage)
    _ok(resumed_run)
    # 7 steps per epoch (node 0's 28 samples in batches of 4): the checkpoint of step 8 is epoch 1's step 1.
    assert "rank 0: start epoch=1 step_in_epoch=1" in resumed_run[0].stdout
    plain, resumed = torch.load(tmp_path / "plain.pt"), torch.load(tmp_path / "resumed.pt")
    assert all(torch.equal(plain[name], resumed[name]) for name in plain)


@pytest.mark.timeout(200)
@pytest.mark.parametrize(
    ("change", "line"),
    [
        ("copy", "node 1 holds shards 1,3 of 5 but node 0 also holds shard 3; keep each shard on one node only"),
        ("remove", "shard 3 of 5 is on no node (node 0 holds 0,2,4; node 1 holds 1); copy it to one node's folder"),
    ],
)
def test_a_shard_on_two_nodes_or_on_none_is_refused_in_one_line(tmp_path, change, line):
    data = _data_set(tmp_path)
    if change == "copy":
        shutil.copyfile(data / "node-1" / "shard-00003.pt", data / "node-0" / "shard-00003.pt")
    else:
        (data / "node-1" / "shard-00003.pt").unlink()
    done = _two_nodes(tmp_path, str(data / "node-{node}"), "out", "final.pt")
    assert [d.returncode for d in done] == [1, 1]
    assert line in done[0].stderr and "Traceback" not in done[0].stderr


@pytest.mark.timeout(300)
def test_resuming_at_another_layout_is_refused_in_one_line(tmp_path):
    data = _data_set(tmp_path)
    _ok(_two_nodes(tmp_path, str(data / "node-{node}"), "ckpt", "two.pt"))
    environ = {k: v for k, v in os.environ.items() if not k.startswith(LAUNCHER_VARIABLES)}
    one_node = subprocess.run(
        [sys.executable, "-m", "ddpkit", "run", "nproc=2", str(SCRIPT), str(data / "all"), "ckpt", "one.pt"],
        cwd=tmp_path,
        env={**environ, "PYTHONPATH": PYTHONPATH},
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert one_node.returncode != 0
    assert (
        "the checkpoint was saved by 2 nodes of 1 rank and this run has 1 node of 2 ranks: node-sharded data "
        "resumes only at the same layout; run nnodes=2 nproc=1"
    ) in one_node.stderr
