"""The examples run as documented."""

import os
import subprocess
import sys

import pytest

from tests.cli_runner import REPO


@pytest.mark.slow
def test_own_training_loop_under_torchrun(tmp_path):
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               str(REPO / "examples" / "own_training_loop.py")]
    out = subprocess.run(command, cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(REPO)},
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    lines = [line for line in out.stdout.splitlines() if line.startswith("epoch")]
    assert len(lines) == 2, out.stdout  # printed by rank 0 only
    assert float(lines[-1].split()[-1].rstrip("%")) > 20.0  # learns beyond chance (10%)
