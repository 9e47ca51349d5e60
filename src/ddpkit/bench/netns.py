"""Emulated hosts for benchmarks and tests: network namespaces joined by one veth pair.

    namespace A                          namespace B
    lo 127.0.0.1                         lo 127.0.0.1
    veth A 10.78.0.1/24  <---- veth ---->  veth B 10.78.0.2/24

Each namespace has its own network stack, so workers in A and B talk over
the veth pair (through the kernel's TCP stack, as between hosts) rather than
loopback. They still share this machine's cores, memory and ``/dev/shm``:
the emulation separates networks, not machines. Needs root and iproute2.
Traffic goes only to the two addresses created here.

Commands run inside a host with ``host.command(argv)`` (prefixes
``ip netns exec NAME``) or ``host.run(argv)``. Names carry the process's pid
and a counter, so concurrent runs do not collide. The benchmarks use
10.78.0.0/24 (:data:`ADDRESSES`); the tests pass their own pair of addresses
(10.77.0.0/24), so the two are told apart wherever they run at once.
"""

from __future__ import annotations

import itertools
import os
import subprocess
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, NamedTuple

ADDRESSES = ("10.78.0.1", "10.78.0.2")
"""Default addresses of host A and host B, on one /24."""
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

    def run(self, argv: Sequence[str], timeout: float = 60.0, **kwargs: Any) -> subprocess.CompletedProcess[str]:
        """Run argv inside this host's namespace and wait; text output is captured."""
        return subprocess.run(self.command(argv), capture_output=True, text=True, timeout=timeout, **kwargs)


class TwoHosts(NamedTuple):
    """Host A and host B, joined by one veth pair on a /24.

    A named tuple, so callers can both unpack it (``a, b = hosts``) and name its fields.
    """

    a: Host
    b: Host


def unavailable_reason() -> str | None:
    """Why namespaces cannot be created here (not root, no ``ip``), or None when they can."""
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    try:
        subprocess.run(["ip", "-V"], capture_output=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return "the ip command (iproute2) is not installed"
    return None


@contextmanager
def two_hosts(addresses: tuple[str, str] = ADDRESSES) -> Iterator[TwoHosts]:
    """Create namespaces A and B joined by a veth pair; delete them on exit, even on failure.

    Args:
        addresses: the addresses of A and B, in one /24 (:data:`PREFIX_LENGTH`).

    Yields:
        Host A and host B, interfaces up, with ``addresses``.

    Raises:
        RuntimeError: an ``ip`` command failed; the message has its output.
    """
    pid, n = os.getpid(), next(_counter)
    a = Host(f"ddpkit-bench-{pid}-{n}-a", f"db{pid}x{n}a", addresses[0])
    b = Host(f"ddpkit-bench-{pid}-{n}-b", f"db{pid}x{n}b", addresses[1])
    assert len(a.interface) <= 15, a.interface  # Linux's IFNAMSIZ - 1
    try:
        for host in (a, b):
            # A namespace with this name can only be left over by a dead process that had our pid.
            subprocess.run(["ip", "netns", "del", host.netns], capture_output=True, check=False)
            _ip("netns", "add", host.netns)
        # Both ends are created directly inside their namespaces, never in the root one.
        _ip("link", "add", a.interface, "netns", a.netns, "type", "veth", "peer", "name", b.interface, "netns", b.netns)
        for host in (a, b):
            _ip("-n", host.netns, "addr", "add", f"{host.address}/{PREFIX_LENGTH}", "dev", host.interface)
            _ip("-n", host.netns, "link", "set", host.interface, "up")
            _ip("-n", host.netns, "link", "set", "lo", "up")
        yield TwoHosts(a, b)
    finally:
        # Deleting a namespace destroys the veth end inside it, and with it the pair.
        for host in (a, b):
            subprocess.run(["ip", "netns", "del", host.netns], capture_output=True, check=False)


def _ip(*args: str) -> None:
    result = subprocess.run(["ip", *args], capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(
            f"'ip {' '.join(args)}' failed (exit {result.returncode}): {result.stderr.strip()}; "
            "emulated nodes need root and iproute2, or run with nodes=[1]"
        )
