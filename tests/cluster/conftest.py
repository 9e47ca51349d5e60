"""The real cluster software the tests under tests/cluster run against."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.helpers.slurm import SlurmCluster, start_slurm_cluster


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[SlurmCluster]:
    """One one-node Slurm cluster (2 CPUs) for the whole session, stopped at its end."""
    with start_slurm_cluster(cpus=2) as cluster:
        yield cluster
