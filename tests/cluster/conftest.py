"""The real cluster software the tests under tests/cluster run against."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.helpers.slurm import SlurmCluster, start_slurm_cluster


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[SlurmCluster]:
    """One one-node Slurm cluster for the whole session, stopped at its end.

    Its node offers 8 CPUs, whatever the machine has, so that a test can run several 2-task jobs at once.
    """
    with start_slurm_cluster(cpus=8) as cluster:
        yield cluster
