"""Choosing gloo's interface: on loopback, and between two network namespaces for real."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ddpkit.env.network import gloo_interface_environ, interface_addresses, interface_for
from tests.helpers.netns import Host, TwoHosts, netns_hosts  # noqa: F401  (fixture)


def test_loopback_is_lo():
    assert interface_for("127.0.0.1") == "lo"
    assert interface_for("localhost") == "lo"
    assert interface_for("::1") == "lo"


@pytest.mark.parametrize("address", ["999.999.999.999", "bad..name"])
def test_unresolvable_host_is_none(address):
    assert interface_for(address) is None
    assert gloo_interface_environ({}, address) == {}


def test_interface_addresses_lists_loopback():
    pairs = {(name, str(address)) for name, address in interface_addresses()}
    assert ("lo", "127.0.0.1") in pairs


def test_gloo_interface_environ():
    assert gloo_interface_environ({}, "127.0.0.1") == {"GLOO_SOCKET_IFNAME": "lo"}
    # The user's choice stands, even one this function would not make.
    assert gloo_interface_environ({"GLOO_SOCKET_IFNAME": "eth7"}, "127.0.0.1") == {}


_QUERY = (
    "import json, sys; from ddpkit.env.network import interface_for; "
    "print(json.dumps({a: interface_for(a) for a in sys.argv[1:]}))"
)


def _interfaces_seen_from(host: Host, *addresses: str) -> dict[str, str | None]:
    result = host.run([sys.executable, "-c", _QUERY, *addresses], timeout=60)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


@pytest.mark.cluster
def test_interface_for_inside_two_namespaces(netns_hosts: TwoHosts):
    a, b = netns_hosts.a, netns_hosts.b
    # 192.0.2.1 is outside both namespaces' only subnet: no route at all.
    assert _interfaces_seen_from(b, a.address, b.address, "127.0.0.1", "192.0.2.1") == {
        a.address: b.interface,
        b.address: b.interface,
        "127.0.0.1": "lo",
        "192.0.2.1": None,
    }
    assert _interfaces_seen_from(a, b.address, a.address) == {b.address: a.interface, a.address: a.interface}


def _start_ranks(hosts: TwoHosts, mode: str, timeout: float) -> list[subprocess.Popen]:
    script = Path(__file__).with_name("_gloo_rank.py")
    base = {k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "LANG", "PYTHONPATH")}
    processes = []
    for rank, host in enumerate((hosts.a, hosts.b)):
        environ = {
            **base,
            "RANK": str(rank),
            "WORLD_SIZE": "2",
            "LOCAL_RANK": "0",
            "LOCAL_WORLD_SIZE": "1",
            "MASTER_ADDR": hosts.a.address,
            # Nothing else runs in the namespace that this test just created: any port is free.
            "MASTER_PORT": "29500",
        }
        command = host.command([sys.executable, str(script), mode, str(timeout)])
        processes.append(
            subprocess.Popen(command, env=environ, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        )
    return processes


def _finish(processes: list[subprocess.Popen], timeout: float) -> list[tuple[int | None, str, str]]:
    """Wait for every rank; once one fails or the timeout passes, kill the rest."""
    deadline = time.monotonic() + timeout
    while any(p.poll() is None for p in processes) and time.monotonic() < deadline:
        if any(p.poll() not in (None, 0) for p in processes):
            break
        time.sleep(0.1)
    for process in processes:
        if process.poll() is None:
            process.kill()
    outputs = [p.communicate() for p in processes]
    return [(p.returncode, out, err) for p, (out, err) in zip(processes, outputs)]


@pytest.mark.slow
@pytest.mark.cluster
def test_gloo_connects_across_namespaces_with_the_chosen_interface(netns_hosts: TwoHosts):
    results = _finish(_start_ranks(netns_hosts, "auto", timeout=30), timeout=90)
    for rank, (code, out, err) in enumerate(results):
        assert code == 0, err
        host = (netns_hosts.a, netns_hosts.b)[rank]
        assert json.loads(out) == {"rank": rank, "sum": 3.0, "ifname": host.interface}


@pytest.mark.slow
@pytest.mark.cluster
def test_gloo_fails_across_namespaces_without_it(netns_hosts: TwoHosts):
    # The control: gloo left alone binds to the host name's loopback address.
    results = _finish(_start_ranks(netns_hosts, "none", timeout=5), timeout=30)
    assert any(code != 0 and "connectFullMesh" in err for code, _, err in results), results
