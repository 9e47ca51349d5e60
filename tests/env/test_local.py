"""The single-process fallback."""

from __future__ import annotations

import socket

import pytest

from ddpkit.env.base import InconsistentEnvironment, JobEnvironment
from ddpkit.env.local import LocalVariables


def test_defaults_to_loopback_and_a_free_port():
    resolved = LocalVariables.from_env({})
    assert resolved == JobEnvironment(
        source="local",
        rank=0,
        local_rank=0,
        world_size=1,
        local_world_size=1,
        node_rank=0,
        num_nodes=1,
        master_addr="127.0.0.1",
        master_port=resolved.master_port,
    )
    with socket.socket() as server:  # the port is free: a store can listen on it
        server.bind(("127.0.0.1", resolved.master_port))


def test_master_addr_and_port_from_the_environment():
    resolved = LocalVariables.from_env({"MASTER_ADDR": "localhost", "MASTER_PORT": "29501"})
    assert (resolved.master_addr, resolved.master_port) == ("localhost", 29501)


def test_foreign_master_addr_raises():
    with pytest.raises(InconsistentEnvironment, match="^MASTER_ADDR='192.0.2.123' is not an address of this host"):
        LocalVariables.from_env({"MASTER_ADDR": "192.0.2.123"})


def test_detects_anything():
    assert LocalVariables.detect({})
