"""The two-host network namespace helper that cluster tests build on."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.helpers.netns import ADDRESSES, two_hosts

_ECHO = """
import socket, sys
server = socket.create_server((sys.argv[1], 0))
print(server.getsockname()[1], flush=True)
conn, _ = server.accept()
conn.sendall(conn.recv(16).upper())
"""


def _namespaces() -> str:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout


@pytest.mark.cluster
def test_hosts_reach_each_other_over_the_veth_pair():
    with two_hosts() as hosts:
        assert (hosts.a.address, hosts.b.address) == ADDRESSES
        assert hosts.a.netns in _namespaces() and hosts.b.netns in _namespaces()
        server = subprocess.Popen(
            hosts.a.command([sys.executable, "-c", _ECHO, hosts.a.address]), stdout=subprocess.PIPE, text=True
        )
        try:
            port = server.stdout.readline().strip()
            client = hosts.b.run(
                [
                    sys.executable,
                    "-c",
                    "import socket, sys; s = socket.create_connection((sys.argv[1], "
                    "int(sys.argv[2])), timeout=10); s.sendall(b'ping'); print(s.recv(16).decode())",
                    hosts.a.address,
                    port,
                ],
                timeout=30,
            )
            assert client.stdout.strip() == "PING", client.stderr
        finally:
            server.kill()
            server.wait()
        # Neither end of the pair is left in the root namespace.
        root_links = subprocess.run(["ip", "-br", "link"], capture_output=True, text=True, check=True).stdout
        assert hosts.a.interface not in root_links and hosts.b.interface not in root_links


@pytest.mark.cluster
def test_namespaces_are_deleted_even_on_failure():
    with pytest.raises(RuntimeError, match="boom"):
        with two_hosts() as hosts:
            names = (hosts.a.netns, hosts.b.netns)
            raise RuntimeError("boom")
    assert not any(name in _namespaces() for name in names)
