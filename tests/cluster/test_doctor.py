"""``ddpkit doctor`` as the ranks of mpirun and srun, where rank 0 hosts the rendezvous store itself."""

from __future__ import annotations

import json
import os
import sys

import pytest

from tests.cli_runner import PYTHONPATH
from tests.helpers.mpi import run_mpirun
from tests.helpers.slurm import SlurmCluster

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

DOCTOR = [sys.executable, "-m", "ddpkit", "doctor", "json=true", "bandwidth_mib=1"]


def check_two_worker_report(report: dict, source: str) -> None:
    assert report["ok"] is True, report["problem"]
    env = report["environment"]
    assert (env["source"], env["rank"], env["world_size"], env["num_nodes"]) == (source, 0, 2, 1)
    assert [(c["name"], c["ok"]) for c in report["checks"]] == [
        ("reach master", True),
        ("roll call", True),
        ("join process group", True),
        ("all_reduce", True),
    ]
    assert [w["rank"] for w in report["workers"]] == [0, 1]
    (peer,) = report["peers"]
    assert peer["rank"] == 1 and peer["latency_us"] > 0 and peer["bandwidth_gbps"] > 0


def test_doctor_under_mpirun():
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MASTER_", "OMPI_", "PMIX_", "SLURM_"))}
    result = run_mpirun(2, DOCTOR, env={**env, "PYTHONPATH": PYTHONPATH}, timeout=180)

    assert result.returncode == 0, result.stderr
    check_two_worker_report(json.loads(result.stdout), "openmpi")


def test_doctor_under_srun(slurm_cluster: SlurmCluster):
    result = slurm_cluster.run(
        ["srun", "-n2", *DOCTOR], env={**slurm_cluster.env, "PYTHONPATH": PYTHONPATH}, timeout=180
    )

    report = json.loads(result.stdout)
    check_two_worker_report(report, "slurm")
    # The port derived from the job id (ddpkit.env.ports.port_from_job_id).
    assert 10000 <= report["environment"]["master_port"] < 30000
