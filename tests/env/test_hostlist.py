"""Slurm hostlist expansion; expected values are what `scontrol show hostnames` prints."""

from __future__ import annotations

import pytest

from ddpkit.env.hostlist import expand_hostlist


@pytest.mark.parametrize(
    ("hostlist", "hosts"),
    [
        ("vm", ["vm"]),
        ("node[01-03,7],gpu-a[1-2]", ["node01", "node02", "node03", "node7", "gpu-a1", "gpu-a2"]),
        (
            "rack[1-2]-node[1-3]",
            ["rack1-node1", "rack1-node2", "rack1-node3", "rack2-node1", "rack2-node2", "rack2-node3"],
        ),
        ("n[1-2][3-4]", ["n13", "n14", "n23", "n24"]),
        ("n[1-2,5]y[1-2]", ["n1y1", "n1y2", "n2y1", "n2y2", "n5y1", "n5y2"]),
        ("n[9-11]", ["n9", "n10", "n11"]),  # width of the lower bound: no padding
        ("n[09-11]", ["n09", "n10", "n11"]),
        ("n[8-010]", ["n8", "n9", "n10"]),
        ("n[001-3]", ["n001", "n002", "n003"]),
        ("n[7]", ["n7"]),
        ("n[1,1]", ["n1", "n1"]),
        ("a[1-2],b", ["a1", "a2", "b"]),
        ("a,,b", ["a", "b"]),
        (" a b ", ["a", "b"]),
        ("host-1.example.org,host-2.example.org", ["host-1.example.org", "host-2.example.org"]),
        ("", []),
    ],
)
def test_expand_hostlist(hostlist, hosts):
    assert expand_hostlist(hostlist) == hosts


def test_large_range_keeps_order_and_padding():
    hosts = expand_hostlist("c[0001-1000]")
    assert len(hosts) == 1000
    assert hosts[0] == "c0001" and hosts[9] == "c0010" and hosts[-1] == "c1000"


@pytest.mark.parametrize(
    ("hostlist", "message"),
    [
        ("n[]", "invalid range ''"),
        ("n[1,]", "invalid range ''"),
        ("n[3-1]", "ends below its start"),
        ("n[1-2", "unclosed '['"),
        ("n1-2]", "']' without '['"),
        ("n[[1]]", "nested '['"),
        ("n[1-2-3]", "invalid range '1-2-3'"),
        ("n[-1]", "invalid range '-1'"),
        ("n[a-b]", "invalid range 'a-b'"),
        ("n[ 1-2]", "invalid range ' 1-2'"),
        ("n[١-٣]", "invalid range"),  # non-ASCII digits are not Slurm's
    ],
)
def test_malformed_hostlist_raises(hostlist, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[")) as raised:
        expand_hostlist(hostlist)
    assert repr(hostlist) in str(raised.value)
