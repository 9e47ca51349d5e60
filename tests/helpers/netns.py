"""Two "hosts" on one machine: network namespaces A and B joined by one veth pair.

    namespace A                          namespace B
    lo 127.0.0.1                         lo 127.0.0.1
    veth A 10.77.0.1/24  <---- veth ---->  veth B 10.77.0.2/24

Commands run inside a host with ``host.command(argv)`` (prefixes
``ip netns exec NAME``) or ``host.run(argv)``. Names carry the test process's
pid and a counter, so concurrent test runs do not collide; the addresses are
the same in every pair, which is fine because each pair lives in its own
namespaces. Needs root and iproute2 (``ip``). Only send traffic to the two
addresses here or to loopback.
"""

from __future__ import annotations

import itertools
import os
import subprocess
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import pytest

ADDRESSES = ("10.77.0.1", "10.77.0.2")
PREFIX_LENGTH = 24

_counter = itertools.count()


@dataclass(frozen=True)
class Host:
    """One namespace, its end of the veth pair and that end's address."""

    netns: str
    interface: str
    address: str

    def command(self, argv: Sequence[str]) -> list[str]:
        """argv prefixed to run inside this host's namespace."""
        return ["ip", "netns", "exec", self.netns, *argv]

    def run(self, argv: Sequence[str], timeout: float = 60.0, **kwargs) -> subprocess.CompletedProcess:
        """Run argv inside this host's namespace and wait; text output is captured."""
        return subprocess.run(self.command(argv), capture_output=True, text=True, timeout=timeout, **kwargs)


@dataclass(frozen=True)
class TwoHosts:
    """Host A and host B, joined by one veth pair on a /24."""

    a: Host
    b: Host


@contextmanager
def two_hosts() -> Iterator[TwoHosts]:
    """Create namespaces A and B joined by a veth pair; delete them on exit, even on failure.

    Yields:
        The two hosts, with interfaces up and addresses 10.77.0.1 and 10.77.0.2.

    Raises:
        subprocess.CalledProcessError: an ``ip`` command failed (not root, no iproute2).
    """
    pid, n = os.getpid(), next(_counter)
    a = Host(netns=f"ddpkit-{pid}-{n}-a", interface=f"dk{pid}x{n}a", address=ADDRESSES[0])
    b = Host(netns=f"ddpkit-{pid}-{n}-b", interface=f"dk{pid}x{n}b", address=ADDRESSES[1])
    assert len(a.interface) <= 15, a.interface  # Linux's IFNAMSIZ - 1
    try:
        for host in (a, b):
            # A namespace with this name can only be left over by a dead process that had our pid.
            subprocess.run(["ip", "netns", "del", host.netns], capture_output=True, check=False)
            _ip("netns", "add", host.netns)
        # Both ends are created directly inside their namespaces, never in the root one.
        _ip("link", "add", a.interface, "netns", a.netns, "type", "veth",
            "peer", "name", b.interface, "netns", b.netns)
        for host in (a, b):
            _ip("-n", host.netns, "addr", "add", f"{host.address}/{PREFIX_LENGTH}", "dev", host.interface)
            _ip("-n", host.netns, "link", "set", host.interface, "up")
            _ip("-n", host.netns, "link", "set", "lo", "up")
        yield TwoHosts(a=a, b=b)
    finally:
        # Deleting a namespace destroys the veth end inside it, and with it the pair.
        for host in (a, b):
            subprocess.run(["ip", "netns", "del", host.netns], capture_output=True, check=False)


@pytest.fixture
def netns_hosts() -> Iterator[TwoHosts]:
    """pytest fixture around two_hosts(); import it into a test module or conftest to use it."""
    with two_hosts() as hosts:
        yield hosts


def _ip(*args: str) -> None:
    result = subprocess.run(["ip", *args], capture_output=True, text=True)
    if result.returncode != 0:
        raise subprocess.CalledProcessError(result.returncode, ["ip", *args], result.stdout, result.stderr)
