"""`ddpkit train` runs unchanged as the workers of a real torchrun job."""

import json
import os
import subprocess
import sys

import pytest

from tests.cli_runner import PYTHONPATH


@pytest.mark.slow
def test_torchrun_two_workers(tmp_path):
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "-m",
        "ddpkit",
        "train",
        "dataset=synthetic",
        "synthetic_samples=512",
        "epochs=1",
        "progress=false",
        "max_restarts=1",  # ddpkit's launcher's option: a worker of torchrun says it does nothing there
        f"output_dir={tmp_path}",
    ]
    out = subprocess.run(
        command, cwd=tmp_path, env={**os.environ, "PYTHONPATH": PYTHONPATH}, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["global_steps"] == 8
    assert "[rank 0/2] torchrun: world_size 2" in out.stderr
    warning = "ddpkit: warning: max_restarts=1 is for ddpkit's own launcher and does nothing in a worker that torchrun"
    assert out.stderr.count(warning) == 1, out.stderr  # rank 0 only
    assert "torchrun --max-restarts 1" in out.stderr
