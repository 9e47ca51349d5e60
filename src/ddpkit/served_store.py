"""A TCPStore that listens on one address only (the server takes a socket ddpkit bound), and which address.

torch's TCPStore server binds the wildcard address (every interface of the
host), whatever host it is given. The store has no authentication (torch's
SECURITY.md: the distributed features assume a trusted network), so
anything that reaches the port can write the keys the workers read. Given a
listening socket (``master_listen_fd``), the server accepts on that socket
instead; :class:`ServedStore` binds it to the one address the job needs:
``127.0.0.1`` for a job on one machine (:mod:`ddpkit.launchers.loopback`),
node 0's address on the interface chosen for the job for a job of several
machines (:mod:`ddpkit.launchers.static`), and rank 0's address on that
interface for a job whose launcher set ``MASTER_ADDR`` (srun, mpirun:
``ddpkit.init``). :func:`listen_address` picks it.
"""

from __future__ import annotations

import ipaddress
import socket
import sys
from datetime import timedelta

# TCPStore's home: torch.distributed re-exports it without listing it, so the type checker misses it there.
from torch._C._distributed_c10d import TCPStore

from ddpkit.env.network import names_loopback, source_address_for
from ddpkit.errors import UserError

WILDCARD = "0.0.0.0"
"""Every IPv4 address of the host: where torch's own store listens."""


def listen_address(master_addr: str, single_host: bool) -> str:
    """The address the host of a job's store serves it on: the one it reaches ``master_addr`` from.

    That is ``master_addr`` itself when it is this host's address, and the
    address of the interface gloo is given (:mod:`ddpkit.env.network`). A
    host name that resolves to loopback here only (Debian's /etc/hosts maps
    the host's own name to 127.0.1.1) while other hosts reach it elsewhere
    gives :data:`WILDCARD` for a job of several hosts, as torch's store
    listens: loopback alone would lock them out (say so with
    :func:`wildcard_warning`).

    Args:
        master_addr: the host name or address every process of the job connects to.
        single_host: every process of the job runs on this host.

    Raises:
        UserError: ``master_addr`` does not resolve here, or no route leads to it.
    """
    address = source_address_for(master_addr)
    if address is None:
        raise UserError(
            f"master_addr={master_addr} does not resolve on the host of rank 0 (node 0) or no route leads to it; "
            "pass node 0's host name or address, as the other nodes reach it"
        )
    if ipaddress.ip_address(address).is_loopback and not single_host and not names_loopback(master_addr):
        return WILDCARD
    return address


def wildcard_warning(master_addr: str) -> str:
    """One line for the host of the store when :func:`listen_address` gave :data:`WILDCARD`."""
    return (
        f"ddpkit: warning: master_addr={master_addr} is a loopback address on node 0, which other hosts cannot "
        "reach: the store listens on every address of node 0, as torch's does; pass node 0's network address "
        "as master_addr to have it listen on that one only"
    )


def warn_if_wildcard(address: str, master_addr: str) -> None:
    """Say :func:`wildcard_warning` on stderr when ``address`` is :data:`WILDCARD`."""
    if address == WILDCARD:
        print(wildcard_warning(master_addr), file=sys.stderr, flush=True)


class ServedStore:
    """A TCPStore server on ``address:port`` only (port 0: a free one), with its own client.

    Args:
        address: The IP address (v4 or v6) to listen on.
        port: The port; 0 asks the OS for a free one.
        timeout: The store's timeout for its operations (and for waiting for clients).
        num_clients: When given, wait (up to ``timeout``) until that many clients, this one included,
            have connected, as torch's static rendezvous does; None: return at once.
        multi_tenant: a TCPStore this process opens later as the host of the same port shares this
            server instead of binding the port again (torch keeps such servers by port): ``ddpkit
            doctor``'s store, which ``ddpkit.init`` then reuses.

    Raises:
        OSError: the address cannot be bound (not this host's, or the port is taken).
    """

    def __init__(
        self,
        address: str,
        port: int,
        timeout: timedelta,
        num_clients: int | None = None,
        multi_tenant: bool = False,
    ):
        family = socket.AF_INET6 if ipaddress.ip_address(address).version == 6 else socket.AF_INET
        listening = socket.socket(family, socket.SOCK_STREAM)
        listening.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listening.bind((address, port))
        listening.listen(socket.SOMAXCONN)
        self.address = address
        """The address it listens on."""
        self.port: int = listening.getsockname()[1]
        """The port it listens on."""
        # The server owns the socket from here on and closes it when it stops.
        self.store: TCPStore | None = TCPStore(
            address,
            self.port,
            num_clients,
            is_master=True,
            master_listen_fd=listening.detach(),
            wait_for_workers=num_clients is not None,
            multi_tenant=multi_tenant,
            use_libuv=True,
            timeout=timeout,
        )
        """The server's own client; None once closed."""

    def close(self) -> None:
        """Stop serving (the server stops with its last reference, here when no handler holds it)."""
        self.store = None


def serve_at_master(
    master_addr: str,
    port: int,
    timeout: timedelta,
    *,
    single_host: bool,
    num_clients: int | None = None,
    multi_tenant: bool = False,
) -> ServedStore:
    """Rank 0 of a job whose launcher set ``MASTER_ADDR`` (``ddpkit.init``, ``ddpkit doctor``): the
    store served on the address :func:`listen_address` picks, said first when it is :data:`WILDCARD`.

    Raises:
        UserError: ``master_addr`` does not resolve here, or no route leads to it.
        OSError: the port is taken.
    """
    address = listen_address(master_addr, single_host)
    warn_if_wildcard(address, master_addr)
    return ServedStore(address, port, timeout, num_clients, multi_tenant)
