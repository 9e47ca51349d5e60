"""``mpirun -np 2 python -m ddpkit train``: OpenMPI's ranks train W1 as one job."""

from __future__ import annotations

import json
import os
import re
import sys

import pytest

from tests.cli_runner import PYTHONPATH
from tests.cluster.short_w1 import W1_SHORT, W1_SHORT_ACCURACY_FLOOR, W1_SHORT_STEPS
from tests.helpers.mpi import run_mpirun

pytestmark = [pytest.mark.cluster, pytest.mark.slow]


@pytest.mark.timeout(600)
def test_mpirun_trains_w1(tmp_path, fashion_mnist):
    output_dir = tmp_path / "runs" / "latest"
    command = [sys.executable, "-m", "ddpkit", "train", "progress=false", f"output_dir={output_dir}", *W1_SHORT]
    # No MASTER_ADDR/MASTER_PORT: ddpkit derives both from OpenMPI's variables.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MASTER_", "OMPI_", "PMIX_", "SLURM_"))}

    result = run_mpirun(2, command, env={**env, "PYTHONPATH": PYTHONPATH}, timeout=500)

    assert result.returncode == 0, result.stderr
    log = result.stdout + result.stderr
    assert "[rank 0/2] openmpi: world_size 2 on 1 node(s)" in log
    summary = json.loads((output_dir / "summary.json").read_text())
    assert summary["world_size"] == 2
    assert (summary["model"], summary["dataset"], summary["global_steps"]) == ("mlp", "fashion-mnist", W1_SHORT_STEPS)
    # A quality bar, in the summary and in rank 0's last line.
    assert summary["test"]["accuracy"] >= W1_SHORT_ACCURACY_FLOOR, summary["test"]
    (printed,) = re.findall(r"\[rank 0/2\] done: .* test accuracy ([0-9.]+)%, train time", log)
    assert float(printed) == pytest.approx(100 * summary["test"]["accuracy"], abs=0.006)
