"""Choosing the network interface gloo uses: the one whose address routes to the master.

gloo binds each rank's sockets to the address of one interface. Left alone it
picks the address the host name resolves to, often 127.0.0.1 or an address
that peers on other hosts cannot reach, and connectFullMesh then fails or
hangs. Setting GLOO_SOCKET_IFNAME to the interface that carries this host's
traffic to the master gives every rank an address the others can reach.

The interface is found the way the kernel would route: connect a UDP socket
to the master (connect on UDP sends nothing, it only picks a route and a
source address), read the source address, and look up which interface holds
it with getifaddrs(3). getifaddrs lists every address, IPv4 and IPv6,
including secondary ones that the SIOCGIFADDR ioctl does not report.
Variables read: GLOO_SOCKET_IFNAME (left as the user set it).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import ipaddress
import os
import socket
import sys
from collections.abc import Mapping

# Any port will do: connect() on a UDP socket only chooses the route.
_PROBE_PORT = 9


def interface_for(address: str) -> str | None:
    """Name the local interface whose address the kernel uses to reach address.

    Args:
        address: Host name or IP address of the peer, e.g. MASTER_ADDR.

    Returns:
        The interface name ("eth0", "lo" for a loopback or own address held
        by lo), or None when address is not a valid host name, does not
        resolve, or no route leads to it.
    """
    source = source_address_for(address)
    if source is None:
        return None
    source_ip = ipaddress.ip_address(source)
    return next((name for name, ip in interface_addresses() if ip == source_ip), None)


def names_loopback(address: str) -> bool:
    """Whether ``address`` says loopback itself: ``localhost`` or a loopback IP address (not a name resolved)."""
    if address == "localhost":
        return True
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


def source_address_for(address: str) -> str | None:
    """The address of this host the kernel sends from to reach address (address itself when it is this host's).

    Args:
        address: Host name or IP address of the peer, e.g. MASTER_ADDR.

    Returns:
        The local IP address, without an IPv6 scope ("10.0.0.5", "fe80::1"),
        or None when address is not a valid host name, does not resolve, or
        no route leads to it.
    """
    try:
        family, _, _, _, sockaddr = socket.getaddrinfo(address, _PROBE_PORT, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as sock:
            sock.connect(sockaddr)
            source: str = sock.getsockname()[0]
    # gaierror for unknown names, ENETUNREACH without a route, UnicodeError for
    # names that are not even syntactically host names ("a..b").
    except (OSError, UnicodeError):
        return None
    return source.split("%")[0]  # drop an IPv6 scope "%eth0"


def gloo_interface_environ(environ: Mapping[str, str], master_addr: str) -> dict[str, str]:
    """The GLOO_SOCKET_IFNAME setting that makes gloo use the route to the master.

    Args:
        environ: The process environment, e.g. os.environ; only read.
        master_addr: Host name or address of rank 0 (JobEnvironment.master_addr).

    Returns:
        {"GLOO_SOCKET_IFNAME": name} for the caller to apply before creating
        the gloo process group; {} when the user already set
        GLOO_SOCKET_IFNAME, or when no interface routes to master_addr.
    """
    if "GLOO_SOCKET_IFNAME" in environ:
        return {}
    name = interface_for(master_addr)
    return {"GLOO_SOCKET_IFNAME": name} if name else {}


class _IfAddrs(ctypes.Structure):
    """struct ifaddrs, the same layout on Linux and the BSDs (macOS) up to ifa_addr."""


_IfAddrs._fields_ = [
    ("ifa_next", ctypes.POINTER(_IfAddrs)),
    ("ifa_name", ctypes.c_char_p),
    ("ifa_flags", ctypes.c_uint),
    ("ifa_addr", ctypes.c_void_p),
]

# struct sockaddr starts with a 16-bit family on Linux; the BSDs put a length
# byte first and the family in the second byte.
_BSD_SOCKADDR = sys.platform != "linux"


def interface_addresses() -> list[tuple[str, ipaddress.IPv4Address | ipaddress.IPv6Address]]:
    """Every (interface name, address) pair of this host, IPv4 and IPv6, from getifaddrs(3).

    Returns:
        Pairs in the order getifaddrs lists them; an interface appears once
        per address.

    Raises:
        OSError: getifaddrs failed.
    """
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    head = ctypes.POINTER(_IfAddrs)()
    if libc.getifaddrs(ctypes.byref(head)) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"getifaddrs: {os.strerror(errno)}")
    pairs: list[tuple[str, ipaddress.IPv4Address | ipaddress.IPv6Address]] = []
    try:
        node = head
        while node:
            entry = node.contents
            if entry.ifa_addr:
                raw = ctypes.string_at(entry.ifa_addr, 24)  # family, port, then the address
                family = raw[1] if _BSD_SOCKADDR else int.from_bytes(raw[:2], sys.byteorder)
                name = entry.ifa_name.decode()
                if family == socket.AF_INET:
                    pairs.append((name, ipaddress.IPv4Address(raw[4:8])))
                elif family == socket.AF_INET6:
                    pairs.append((name, ipaddress.IPv6Address(raw[8:24])))
            node = entry.ifa_next
    finally:
        libc.freeifaddrs(head)
    return pairs
