"""Emulated hosts for benchmarks: network namespaces joined by one veth pair.

    namespace A                          namespace B
    lo 127.0.0.1                         lo 127.0.0.1
    veth A 10.78.0.1/24  <---- veth ---->  veth B 10.78.0.2/24

Each namespace has its own network stack, so workers in A and B talk over
the veth pair (through the kernel's TCP stack, as between hosts) rather than
loopback. They still share this machine's cores, memory and ``/dev/shm``:
the emulation separates networks, not machines. Needs root and iproute2.
Traffic goes only to the two addresses created here.
"""

from __future__ import annotations

import itertools
import os
import subprocess
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

ADDRESSES = ("10.78.0.1", "10.78.0.2")
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
def two_hosts() -> Iterator[tuple[Host, Host]]:
    """Create namespaces A and B joined by a veth pair; delete them on exit, even on failure.

    Yields:
        Host A and host B, interfaces up, addresses 10.78.0.1 and 10.78.0.2.

    Raises:
        RuntimeError: an ``ip`` command failed; the message has its output.
    """
    pid, n = os.getpid(), next(_counter)
    a = Host(f"ddpkit-bench-{pid}-{n}-a", f"db{pid}x{n}a", ADDRESSES[0])
    b = Host(f"ddpkit-bench-{pid}-{n}-b", f"db{pid}x{n}b", ADDRESSES[1])
    assert len(a.interface) <= 15, a.interface  # Linux's IFNAMSIZ - 1
    try:
        for host in (a, b):
            _ip("netns", "add", host.netns)
        _ip("link", "add", a.interface, "netns", a.netns, "type", "veth", "peer", "name", b.interface, "netns", b.netns)
        for host in (a, b):
            _ip("-n", host.netns, "addr", "add", f"{host.address}/{PREFIX_LENGTH}", "dev", host.interface)
            _ip("-n", host.netns, "link", "set", host.interface, "up")
            _ip("-n", host.netns, "link", "set", "lo", "up")
        yield a, b
    finally:
        # Deleting a namespace destroys the veth end inside it, and with it the pair.
        for host in (a, b):
            subprocess.run(["ip", "netns", "del", host.netns], capture_output=True, check=False)


def _ip(*args: str) -> None:
    result = subprocess.run(["ip", *args], capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"'ip {' '.join(args)}' failed (exit {result.returncode}): {result.stderr.strip()}; "
                           "emulated nodes need root and iproute2, or run with nodes=[1]")
