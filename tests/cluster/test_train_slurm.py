"""``ddpkit slurm --submit`` on a real one-node Slurm cluster trains W1 with 2 srun tasks."""

from __future__ import annotations

import json
import re

import pytest

from ddpkit.cli import main
from tests.cli_runner import PYTHONPATH
from tests.cluster.short_w1 import W1_SHORT, W1_SHORT_ACCURACY_FLOOR, W1_SHORT_STEPS
from tests.helpers.slurm import SlurmCluster

pytestmark = [pytest.mark.cluster, pytest.mark.slow]


@pytest.mark.timeout(600)
def test_ddpkit_slurm_submit_trains_w1(slurm_cluster: SlurmCluster, tmp_path, fashion_mnist, monkeypatch, capsys):
    words = [
        "slurm", "submit=true", "launch=srun", "tasks_per_node=2",
        f"project_root={tmp_path}", "output=logs/train-%j.out", "job_name=w1",
        "progress=false", *W1_SHORT,
    ]
    # ddpkit slurm in this process (tests/cluster/test_slurm_cluster.py runs the command); sbatch passes its
    # environment on to the job: the workers import this checkout.
    slurm_cluster.patch_environ(monkeypatch, PYTHONPATH=PYTHONPATH)
    assert main(words) == 0
    job_id = int(capsys.readouterr().out)

    result = slurm_cluster.wait(job_id, timeout=500)

    assert result.state == "COMPLETED", result.output
    assert result.exit_code == "0:0"
    assert result.info["StdOut"] == str(tmp_path / "logs" / f"train-{job_id}.out")
    assert "[rank 0/2] slurm: world_size 2 on 1 node(s)" in result.output
    done = r"\[rank 0/2\] done: mlp on fashion-mnist, 2 worker\(s\), test accuracy ([0-9.]+)%"
    (accuracy,) = re.findall(done, result.output)
    assert float(accuracy) >= 100 * W1_SHORT_ACCURACY_FLOOR, result.output
    # The job ran in the project root, into a run folder of its own named by the job id; runs/latest points to it.
    assert (tmp_path / "runs" / "latest").resolve() == tmp_path / "runs" / "mlp-fashion-mnist" / f"slurm-{job_id}"
    summary = json.loads((tmp_path / "runs" / "latest" / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["global_steps"] == W1_SHORT_STEPS
    assert summary["test"]["accuracy"] == pytest.approx(float(accuracy) / 100, abs=0.00006)
