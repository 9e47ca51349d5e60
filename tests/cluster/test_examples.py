"""The own-script examples under real srun and mpirun (ddpkit run and torchrun, and which example each launcher
starts: tests/test_examples.py)."""

from __future__ import annotations

import sys

import pytest

from tests.cli_runner import PYTHONPATH
from tests.helpers.mpi import run_mpirun
from tests.test_examples import LAUNCHED_BY, TINY, _check, _environ, _script

pytestmark = [pytest.mark.cluster, pytest.mark.slow]


@pytest.mark.parametrize("example", [LAUNCHED_BY["mpirun"]])
def test_example_under_mpirun(example, tmp_path):
    command = [sys.executable, _script(example), *TINY, "--out", str(tmp_path)]
    _check(run_mpirun(2, command, env=_environ(), timeout=300), example)


@pytest.mark.parametrize("example", [LAUNCHED_BY["srun"]])
def test_example_under_srun(example, slurm_cluster, tmp_path):
    command = [
        "srun",
        "--ntasks=2",
        "--ntasks-per-node=2",
        "--kill-on-bad-exit=1",
        f"--chdir={tmp_path}",
        sys.executable,
        _script(example),
        *TINY,
        "--out",
        str(tmp_path),
    ]
    env = {**slurm_cluster.env, "PYTHONPATH": PYTHONPATH}
    _check(slurm_cluster.run(command, env=env, timeout=300, check=False), example)
