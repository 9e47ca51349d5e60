"""A TCPStore that listens on one address only: the server takes a socket ddpkit bound.

torch's TCPStore server binds the wildcard address (every interface of the
host), whatever host it is given. The store has no authentication (torch's
SECURITY.md: the distributed features assume a trusted network), so
anything that reaches the port can write the keys the workers read. Given a
listening socket (``master_listen_fd``), the server accepts on that socket
instead; :class:`ServedStore` binds it to the one address the job needs:
``127.0.0.1`` for a job on one machine (:mod:`ddpkit.launch.loopback`),
node 0's address on the interface chosen for the job for a job of several
machines (:mod:`ddpkit.launch.static`).
"""

from __future__ import annotations

import ipaddress
import socket
from datetime import timedelta

from torch.distributed import TCPStore


class ServedStore:
    """A TCPStore server on ``address:port`` only (port 0: a free one), with its own client.

    Args:
        address: The IP address (v4 or v6) to listen on.
        port: The port; 0 asks the OS for a free one.
        timeout: The store's timeout for its operations (and for waiting for clients).
        num_clients: When given, wait (up to ``timeout``) until that many clients, this one included,
            have connected, as torch's static rendezvous does; None: return at once.

    Raises:
        OSError: the address cannot be bound (not this host's, or the port is taken).
    """

    def __init__(self, address: str, port: int, timeout: timedelta, num_clients: int | None = None):
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
            multi_tenant=False,
            use_libuv=True,
            timeout=timeout,
        )
        """The server's own client; None once closed."""

    def close(self) -> None:
        """Stop serving (the server stops with its last reference, here when no handler holds it)."""
        self.store = None
