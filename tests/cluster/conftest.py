"""The real cluster software the tests under tests/cluster run against."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from tests.helpers.slurm import SlurmCluster, start_slurm_cluster, unavailable_reason


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[SlurmCluster]:
    """One one-node Slurm cluster for the whole session, stopped at its end.

    Its node offers 8 CPUs, whatever the machine has, so that a test can run several 2-task jobs at once.
    Where Slurm cannot start (not root, not installed) the tests that need it are skipped with the reason,
    except in CI, which installs it: there they fail.
    """
    reason = unavailable_reason()
    if reason:
        if os.environ.get("CI", "").lower() in {"true", "1"}:
            pytest.fail(reason)
        pytest.skip(reason)
    with start_slurm_cluster(cpus=8, first_job_id=_first_job_id()) as cluster:
        yield cluster


def _first_job_id() -> int:
    """1 in pytest-xdist's worker gw0 (or without xdist), 1001 in gw1, 2001 in gw2, ...

    Every xdist worker starts a cluster of its own, and ddpkit derives a job's rendezvous port from its
    job id (10000 + id): clusters numbering their jobs from the same id would give two jobs running at
    the same time the same port.
    """
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    return 1 + 1000 * int(worker.removeprefix("gw"))
