"""The diagnoses of failed checks, in plain words: what failed, where, and what to check.

Each one is a pure function of the environment and what the checks saw, so
the messages are tested on plain data.
"""

from __future__ import annotations

import errno
import os
import socket
from collections.abc import Sequence

from ddpkit.doctor.results import WorkerInfo
from ddpkit.env.base import JobEnvironment
from ddpkit.env.network import names_loopback


def unreachable_diagnosis(env: JobEnvironment, error: OSError, timeout: float) -> str:
    """What to check when rank ``env.rank`` cannot connect to the master's port."""
    where = f"{env.master_addr}:{env.master_port}"
    if isinstance(error, ConnectionRefusedError):
        why = "connection refused: nothing listens there"
        check = (
            f"check that rank 0 is running, that MASTER_PORT={env.master_port} is the same on every worker, "
            f"and that MASTER_ADDR={env.master_addr} is rank 0's host"
        )
    elif isinstance(error, TimeoutError) or error.errno == errno.ETIMEDOUT:
        why = "no answer (connection timed out)"
        check = (
            f"check that MASTER_ADDR={env.master_addr} is an address of rank 0's host that this host reaches "
            f"(`ip route get {env.master_addr}`, `ping {env.master_addr}`) and that no firewall drops "
            f"port {env.master_port}"
        )
    elif error.errno in (errno.ENETUNREACH, errno.EHOSTUNREACH):
        why = f"no route ({os.strerror(error.errno)})"
        check = (
            f"check this host's routes to {env.master_addr} (`ip route get {env.master_addr}`) "
            "and the network between the hosts"
        )
    else:
        why = str(error)
        check = f"check MASTER_ADDR={env.master_addr}, MASTER_PORT={env.master_port} and the network between the hosts"
    text = f"rank {env.rank}/{env.world_size} cannot reach the master at {where} within {timeout:g}s: {why}; {check}"
    if names_loopback(env.master_addr) and env.num_nodes > 1:
        text += (
            f". MASTER_ADDR={env.master_addr} is a loopback address, but the job spans {env.num_nodes} nodes: "
            "set it to an address of rank 0's host that the other hosts reach. Under torchrun with "
            "--rdzv-backend c10d, pass --local-addr <this node's address> on every node: without it the "
            "rendezvous names the master by its host name, which may resolve to loopback"
        )
    return text


def unresolvable_diagnosis(env: JobEnvironment, error: socket.gaierror) -> str:
    return (
        f"rank {env.rank}/{env.world_size} cannot resolve MASTER_ADDR={env.master_addr!r} ({error.strerror}); "
        "set MASTER_ADDR to an IP address or a host name that every node resolves (check /etc/hosts or DNS)"
    )


def missing_diagnosis(
    env: JobEnvironment, missing: Sequence[int], present: Sequence[WorkerInfo], timeout: float
) -> str:
    """What to check when ranks did not arrive at the roll call."""
    hosts = sorted({f"{w.host} ({w.address})" for w in present})
    return (
        f"{_ranks(missing)} of {env.world_size} did not arrive at {env.master_addr}:{env.master_port} "
        f"within {timeout:g}s ({len(present)} arrived, from {', '.join(hosts)}); check that the missing workers were "
        "started with the same world size, master address and port, and look at their own output: a worker "
        "that cannot reach the master says so"
    )


def loopback_diagnosis(env: JobEnvironment, workers: Sequence[WorkerInfo]) -> str:
    """A problem when a worker would bind gloo to loopback while a peer is on another host; else ""."""
    for w in workers:
        if not names_loopback(w.address):
            continue
        others = [o.rank for o in workers if o.stack != w.stack]
        if others:
            return (
                f"rank {w.rank} binds gloo to {w.address} ({w.interface or 'its host name'}), a loopback address, "
                f"but {_ranks(others)} on another host cannot connect to it; check the routes "
                f"between the hosts (`ip route get <peer address>`), or set GLOO_SOCKET_IFNAME to the interface "
                "whose address the other hosts reach (or unset it: ddpkit then picks the interface that routes "
                "to the master)"
            )
    return ""


def join_diagnosis(env: JobEnvironment, error: str, workers: Sequence[WorkerInfo]) -> str:
    """What to check when ``ddpkit.init`` failed after every worker reached the store."""
    first = error.splitlines()[0] if error else "unknown error"
    if "gloo" in error.lower() or "connectFullMesh" in error:
        addresses = ", ".join(f"rank {w.rank} {w.address} ({w.interface or 'host name'})" for w in workers)
        return (
            f"rank {env.rank}/{env.world_size}: gloo could not connect the workers to each other ({first}). "
            f"Each worker binds gloo to one address and every other worker must reach it: {addresses or 'unknown'}. "
            "Check the routes between the hosts (`ip route get <peer address>` on each) and that no firewall "
            "blocks ports between them, or set GLOO_SOCKET_IFNAME to the interface that reaches the other hosts"
        )
    return f"rank {env.rank}/{env.world_size} could not join the process group: {first}"


def loopback_master_warning(env: JobEnvironment) -> str:
    """A warning when MASTER_ADDR is a loopback address for a job of several nodes; else ""."""
    if names_loopback(env.master_addr) and env.num_nodes > 1:
        return (
            f"MASTER_ADDR={env.master_addr} is a loopback address but the job spans {env.num_nodes} nodes; "
            "workers on other hosts cannot reach it unless every node is this host"
        )
    return ""


def _ranks(ranks: Sequence[int]) -> str:
    """[3] -> "rank 3"; [0, 1, 2, 5] -> "ranks 0-2, 5"."""
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {_ranges(ranks)}"


def _ranges(ranks: Sequence[int]) -> str:
    """[0, 1, 2, 5] -> "0-2, 5"."""
    parts, start = [], None
    for i, r in enumerate(ranks):
        if start is None:
            start = r
        if i + 1 == len(ranks) or ranks[i + 1] != r + 1:
            parts.append(str(start) if start == r else f"{start}-{r}")
            start = None
    return ", ".join(parts)
