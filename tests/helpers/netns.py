"""Two "hosts" on one machine for tests: :mod:`ddpkit.bench.netns` on the tests' own addresses.

The tests use 10.77.0.1 and 10.77.0.2, the benchmarks 10.78.0.x, so a test
run and a benchmark running at the same time are told apart. Needs root and
iproute2 (``ip``). Only send traffic to the two addresses here or to loopback.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager

import pytest

from ddpkit.bench import netns
from ddpkit.bench.netns import Host, TwoHosts

__all__ = ["ADDRESSES", "Host", "TwoHosts", "netns_hosts", "two_hosts"]

ADDRESSES = ("10.77.0.1", "10.77.0.2")


def two_hosts() -> AbstractContextManager[TwoHosts]:
    """:func:`ddpkit.bench.netns.two_hosts` with host A at 10.77.0.1 and host B at 10.77.0.2.

    Raises:
        RuntimeError: an ``ip`` command failed (not root, no iproute2).
    """
    return netns.two_hosts(ADDRESSES)


@pytest.fixture
def netns_hosts() -> Iterator[TwoHosts]:
    """pytest fixture around two_hosts(); import it into a test module or conftest to use it."""
    with two_hosts() as hosts:
        yield hosts
