"""TCP ports for the rendezvous store: a free one from the OS, or one derived from a job id.

Ports derived from a job id fall in [10000, 30000): below Linux's ephemeral
range (32768-60999 by default), so a port the OS hands out to an outgoing
connection on the master never takes it, and above the well-known and most
registered service ports.
"""

from __future__ import annotations

import socket
import zlib

JOB_PORT_BASE = 10000
"""First port that :func:`port_from_job_id` returns."""
JOB_PORT_SPAN = 20000
"""Number of ports that :func:`port_from_job_id` spreads job ids over."""


def free_port(host: str = "127.0.0.1") -> int:
    """Ask the OS for a TCP port that is free on host right now.

    The port is released before returning, so another process may take it
    before the caller binds it: use it at once, on the same host.

    Args:
        host: Local address to bind, IPv4 or IPv6 ("::1").

    Returns:
        A port number in 1..65535.

    Raises:
        OSError: host is not a local address.
    """
    family, kind, proto, _, address = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0]
    with socket.socket(family, kind, proto) as sock:
        sock.bind(address)
        port: int = sock.getsockname()[1]
        return port


def port_from_job_id(job_id: str) -> int:
    """Derive a port every process of one job computes identically, from its job id.

    The port is ``10000 + n % 20000`` where n is the job id itself when it is
    a decimal number (a Slurm job id), else the CRC-32 of its UTF-8 text (an
    MPI namespace such as "2146435073" or "prterun-host-1234@1"). Consecutive
    Slurm jobs get consecutive ports, so two jobs collide only 20000 jobs apart.
    CRC-32 rather than hash(): Python salts hash() per process.

    Args:
        job_id: Identifier of the job, the same text in every process of it.

    Returns:
        A port in [10000, 30000).
    """
    n = int(job_id) if job_id.isdecimal() else zlib.crc32(job_id.encode())
    return JOB_PORT_BASE + n % JOB_PORT_SPAN
