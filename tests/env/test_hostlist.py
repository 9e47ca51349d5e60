"""Slurm hostlist expansion; expected values are what `scontrol show hostnames` prints.

Names after a bracket group (``n[1-2]-ib``) follow Slurm 23.02 and later;
tests/cluster/test_hostlist_scontrol.py compares with scontrol itself.
"""

from __future__ import annotations

import itertools
import tracemalloc

import pytest

from ddpkit.env.base import InconsistentEnvironment
from ddpkit.env.hostlist import MAX_NAMES_PER_RANGE, count_hosts, expand_hostlist, first_host, iter_hosts
from ddpkit.env.slurm import SlurmVariables


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
        ("[1-2]", ["1", "2"]),
        ("n1[2-3]", ["n12", "n13"]),
        ("n[1-2]-ib", ["n1-ib", "n2-ib"]),  # Slurm 23.02 and later; 22.05 refuses it
        ("n[1-2]-ib,m[3]", ["n1-ib", "n2-ib", "m3"]),
    ],
)
def test_expand_hostlist(hostlist, hosts):
    assert expand_hostlist(hostlist) == hosts


# Slurm nests the second-to-last group outermost, then the groups before it leftwards, the last innermost.
@pytest.mark.parametrize(
    ("hostlist", "hosts"),
    [
        (
            "row[0,1]_rack[2-3]_blade[4,5]",
            "row0_rack2_blade4 row0_rack2_blade5 row1_rack2_blade4 row1_rack2_blade5 "
            "row0_rack3_blade4 row0_rack3_blade5 row1_rack3_blade4 row1_rack3_blade5",
        ),
        (
            "x01[0-1]y01[0-1]z01[0-1]",
            "x010y010z010 x010y010z011 x011y010z010 x011y010z011 x010y011z010 x010y011z011 x011y011z010 x011y011z011",
        ),
        (
            "a[1-2]b[3-4]c[5-6]d[7-8]",
            "a1b3c5d7 a1b3c5d8 a2b3c5d7 a2b3c5d8 a1b4c5d7 a1b4c5d8 a2b4c5d7 a2b4c5d8 "
            "a1b3c6d7 a1b3c6d8 a2b3c6d7 a2b3c6d8 a1b4c6d7 a1b4c6d8 a2b4c6d7 a2b4c6d8",
        ),
        ("c[0-1]-[3-4]-ib[5,7]", "c0-3-ib5 c0-3-ib7 c1-3-ib5 c1-3-ib7 c0-4-ib5 c0-4-ib7 c1-4-ib5 c1-4-ib7"),
        (
            "c[0-1]-[3-4]-ib[5,7]-x",
            "c0-3-ib5-x c0-3-ib7-x c1-3-ib5-x c1-3-ib7-x c0-4-ib5-x c0-4-ib7-x c1-4-ib5-x c1-4-ib7-x",
        ),
        ("n[1-2][3-4][5,06]", "n135 n1306 n235 n2306 n145 n1406 n245 n2406"),
    ],
)
def test_three_or_more_groups_expand_in_slurms_order(hostlist, hosts):
    assert expand_hostlist(hostlist) == hosts.split()
    assert list(iter_hosts(hostlist)) == hosts.split()
    assert count_hosts(hostlist) == len(hosts.split())
    assert first_host(hostlist) == hosts.split()[0]


def test_large_range_keeps_order_and_padding():
    hosts = expand_hostlist("c[0001-1000]")
    assert len(hosts) == 1000
    assert hosts[0] == "c0001" and hosts[9] == "c0010" and hosts[-1] == "c1000"


def test_largest_legal_range_and_a_last_group_beyond_it():
    assert count_hosts("n[0-65535]") == MAX_NAMES_PER_RANGE == 65_536
    assert expand_hostlist("n[1-65536]")[-1] == "n65536"
    # Slurm caps each range and each group before the last, not the last group as a whole.
    assert count_hosts("b[0-40000,0-40000]") == 80_002


@pytest.mark.parametrize(
    ("hostlist", "count"),
    [("", 0), ("vm", 1), ("a,,b", 2), ("n[1,1]", 2), ("n[1-3],m[1-2]x[1-2]", 7), ("n[0-65535]x[0-65535]", 2**32)],
)
def test_count_hosts(hostlist, count):
    assert count_hosts(hostlist) == count


def test_first_host_of_an_empty_hostlist_is_none():
    assert first_host("") is None
    assert first_host(" , ") is None


def test_huge_legal_hostlist_is_never_expanded():
    # 2**48 names: expanding even a fraction would not fit in memory or time.
    hostlist = "n[0-65535]x[0-65535]y[0-65535]"
    tracemalloc.start()
    try:
        assert first_host(hostlist) == "n0x0y0"
        assert count_hosts(hostlist) == 2**48
        assert list(itertools.islice(iter_hosts(hostlist), 3)) == ["n0x0y0", "n0x0y1", "n0x0y2"]
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1_000_000, f"peak {peak:,} bytes: the list was expanded"


@pytest.mark.parametrize(
    ("hostlist", "message"),
    [
        ("n[0-9999999]", "range '0-9999999' in hostlist 'n[0-9999999]' has 10,000,000 names, more than the 65,536"),
        ("n[1-1000000]", "has 1,000,000 names, more than the 65,536 Slurm allows in one range"),
        ("foo[0-1048576]", "has 1,048,577 names"),
        ("n[0-65536]", "has 65,537 names"),
        ("ok,n[1-2,0-65536]y[1]", "range '0-65536'"),
        (
            "a[0-40000,0-40000]b[1]",
            "bracket group [0-40000,0-40000] in hostlist 'a[0-40000,0-40000]b[1]' has 80,002 names, more than the "
            "65,536 Slurm allows in a group before the last",
        ),
    ],
)
def test_slurms_limits_are_a_one_line_error(hostlist, message):
    for function in (expand_hostlist, iter_hosts, first_host, count_hosts):
        with pytest.raises(ValueError) as raised:
            function(hostlist)
        assert message in str(raised.value)
        assert "Slurm refuses this hostlist too" in str(raised.value) and "split" in str(raised.value)
        assert "\n" not in str(raised.value)


def test_limit_error_is_found_without_expanding():
    tracemalloc.start()
    try:
        with pytest.raises(ValueError, match="65,536"):
            first_host("n[0-9999999]")
        with pytest.raises(ValueError, match="65,536"):
            first_host("a[0-65535]b[0-65535]c[0-65536]")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1_000_000, f"peak {peak:,} bytes"


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


def _one_task_step(nodelist: str) -> dict[str, str]:
    zeros = dict.fromkeys(("SLURM_PROCID", "SLURM_LOCALID", "SLURM_NODEID", "SLURM_STEP_ID"), "0")
    return {**zeros, "SLURM_NTASKS": "1", "SLURM_NNODES": "1", "SLURM_JOB_ID": "7", "SLURM_STEP_NODELIST": nodelist}


def test_slurm_master_address_of_huge_node_lists_without_expanding():
    tracemalloc.start()
    try:
        assert SlurmVariables.from_env(_one_task_step("n[0-65535]x[0-65535]")).master_addr == "n0x0"
        with pytest.raises(InconsistentEnvironment) as raised:
            SlurmVariables.from_env(_one_task_step("n[0-9999999]"))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1_000_000, f"peak {peak:,} bytes"
    message = str(raised.value)
    assert message.startswith("SLURM_STEP_NODELIST: range '0-9999999'") and "65,536" in message
    assert "\n" not in message


def test_first_host_checks_the_whole_hostlist():
    # Slurm refuses the whole list for one bad expression, so the first name is not enough.
    with pytest.raises(ValueError, match="invalid range 'x'"):
        first_host("n1,n[x]")
