"""OpenMPI's mpirun runs here: ranks start, see their OMPI_* identity, and stop."""

from __future__ import annotations

import sys

import pytest

from ddpkit.launchers.hostfile import render_hostfile
from tests.helpers.mpi import run_mpirun

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

# One write per line: mpirun merges the ranks' output write by write (print() makes several unbuffered).
PRINT_IDENTITY = (
    "import os, sys; e = os.environ; sys.stdout.write(' '.join(["
    "e['OMPI_COMM_WORLD_RANK'], e['OMPI_COMM_WORLD_SIZE'], e['OMPI_COMM_WORLD_LOCAL_RANK'], str(e.get('DDPKIT_PROBE'))"
    "]) + '\\n')"
)


def test_mpirun_reads_a_rendered_hostfile_and_starts_two_ranks_that_know_their_rank(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text(render_hostfile(["localhost"], slots=2))

    result = run_mpirun(
        2, [sys.executable, "-c", PRINT_IDENTITY], hostfile=str(hostfile), export=["DDPKIT_PROBE=seen"], timeout=60
    )

    assert result.returncode == 0, result.stderr
    assert sorted(result.stdout.split("\n")[:-1]) == ["0 2 0 seen", "1 2 1 seen"]


def test_a_failing_rank_fails_mpirun():
    exit_by_rank = "import os, sys; sys.exit(int(os.environ['OMPI_COMM_WORLD_RANK']) * 3)"
    result = run_mpirun(2, [sys.executable, "-c", exit_by_rank])

    assert result.returncode != 0
