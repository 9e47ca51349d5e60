"""Free ports from the OS and ports derived from job ids."""

from __future__ import annotations

import socket
import zlib

import pytest

from ddpkit.env.ports import free_port, port_from_job_id


@pytest.mark.parametrize("host", ["127.0.0.1", "::1", "localhost"])
def test_free_port_can_be_listened_on(host):
    port = free_port(host)
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    with socket.socket(family, socket.SOCK_STREAM) as server:
        server.bind((host, port))
        server.listen()


def test_free_port_rejects_a_foreign_address():
    with pytest.raises(OSError):
        free_port("192.0.2.123")  # TEST-NET-1: never an address of this host


@pytest.mark.parametrize(
    ("job_id", "port"),
    [("0", 10000), ("1", 10001), ("19999", 29999), ("20000", 10000), ("123456", 10000 + 123456 % 20000)],
)
def test_port_from_slurm_job_id(job_id, port):
    assert port_from_job_id(job_id) == port


def test_port_from_text_job_id_is_crc32_and_stable():
    job_id = "prterun-host-1234@1"
    # A literal, so that a change of hash (or of Python's str hash seed) cannot go unnoticed:
    # zlib.crc32(b"prterun-host-1234@1") is 2038099494.
    assert zlib.crc32(job_id.encode()) == 2038099494
    assert port_from_job_id(job_id) == 10000 + 2038099494 % 20000 == 29494
    assert port_from_job_id(job_id) != port_from_job_id("prterun-host-1235@1")
    assert all(10000 <= port_from_job_id(f"ns{i}") < 30000 for i in range(1000))
