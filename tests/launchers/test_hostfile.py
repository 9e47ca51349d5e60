"""MPI hostfiles: rendering, parsing, and the errors of both."""

from __future__ import annotations

import pytest

from ddpkit.launchers.hostfile import parse_hostfile, render_hostfile, total_slots


def test_render_gives_one_line_per_host():
    assert render_hostfile(["node1", "node2", "10.0.0.3"], slots=4) == (
        "node1 slots=4\nnode2 slots=4\n10.0.0.3 slots=4\n"
    )


def test_parse_reads_back_what_render_writes():
    hosts = ["a", "b.example.org", "c"]
    assert parse_hostfile(render_hostfile(hosts, slots=2)) == [(h, 2) for h in hosts]


def test_parse_accepts_hand_written_files():
    text = """\
# lab machines
gpu1 slots=4 max_slots=8
gpu2\tslots = 2

gpu3            # one slot
gpu4 slots 3
"""
    entries = parse_hostfile(text)
    assert entries == [("gpu1", 4), ("gpu2", 2), ("gpu3", 1), ("gpu4", 3)]
    assert total_slots(entries) == 10


@pytest.mark.parametrize(
    "hosts, slots, message",
    [
        ([], 1, "hosts is empty"),
        (["a"], 0, "slots=0 must be an integer >= 1"),
        (["a", "a"], 1, "host 'a' is listed twice"),
        (["a b"], 1, "host 'a b' is not a host name"),
        (["a=1"], 1, "host 'a=1' is not a host name"),
    ],
)
def test_render_rejects_bad_input(hosts, slots, message):
    with pytest.raises(ValueError, match=message):
        render_hostfile(hosts, slots)


@pytest.mark.parametrize(
    "text, message",
    [
        ("a slots=4\nb slots=x\n", "hostfile line 2: slots='x' must be an integer >= 1"),
        ("a slots=0\n", "hostfile line 1: slots='0' must be an integer >= 1"),
        ("slots=4\n", "hostfile line 1: 'slots=4' does not start with a host name"),
    ],
)
def test_parse_names_the_bad_line(text, message):
    with pytest.raises(ValueError, match=message):
        parse_hostfile(text)
