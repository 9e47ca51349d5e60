"""MPI hostfiles: which hosts mpirun may start ranks on, and how many on each.

Outside Slurm, mpirun learns its hosts from a hostfile, one host a line in
OpenMPI's format (MPICH's Hydra reads ``host:N`` instead)::

    node1 slots=4
    node2 slots=4

and ``ddpkit train`` runs under it unchanged, reading OMPI_COMM_WORLD_*::

    mpirun --hostfile hosts -np 8 python -m ddpkit train model=mlp

Inside a Slurm allocation OpenMPI reads the allocation itself: no hostfile.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from ddpkit.errors import UserError

# A host name or address: no whitespace, no "#" (comment), no "=" (option).
_HOST = re.compile(r"[^\s#=]+")


def render_hostfile(hosts: Sequence[str], slots: int) -> str:
    """An OpenMPI hostfile giving each host the same number of slots.

    Args:
        hosts: Host names or addresses, in rank order (ranks fill the first
            host's slots first under mpirun's default ``--map-by slot``).
        slots: Ranks each host may run, usually its GPU or core count.

    Returns:
        One ``host slots=N`` line per host, ending in a newline.

    Raises:
        ValueError: no hosts, a host repeated or not a plain name, or slots < 1.
    """
    if not hosts:
        raise UserError("hosts is empty; give at least one host name")
    if not isinstance(slots, int) or slots < 1:
        raise UserError(f"slots={slots!r} must be an integer >= 1")
    seen: set[str] = set()
    for host in hosts:
        if not _HOST.fullmatch(host):
            raise UserError(f"host {host!r} is not a host name or address (no spaces, '#' or '=')")
        if host in seen:
            raise UserError(f"host {host!r} is listed twice; list each host once and set slots")
        seen.add(host)
    return "".join(f"{host} slots={slots}\n" for host in hosts)


def parse_hostfile(text: str) -> list[tuple[str, int]]:
    """Hosts and slot counts of an OpenMPI hostfile.

    Accepts what :func:`render_hostfile` writes and the hand-written form:
    ``#`` comments, blank lines, a bare host (1 slot), ``slots=N`` or
    ``slots N``, and other options such as ``max_slots=N`` (ignored).

    Args:
        text: The content of the hostfile.

    Returns:
        (host, slots) pairs in file order.

    Raises:
        ValueError: a line is malformed; the message gives its number.
    """
    entries: list[tuple[str, int]] = []
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        host, *rest = line.split(None, 1)
        options = rest[0] if rest else ""
        slots = 1
        match = re.search(r"(?:^|\s)slots\s*[=\s]\s*(\S+)", options)
        if match:
            if not match.group(1).isdecimal() or int(match.group(1)) < 1:
                raise UserError(f"hostfile line {number}: slots={match.group(1)!r} must be an integer >= 1")
            slots = int(match.group(1))
        if not _HOST.fullmatch(host):
            raise UserError(f"hostfile line {number}: {raw.strip()!r} does not start with a host name")
        entries.append((host, slots))
    return entries


def total_slots(entries: Sequence[tuple[str, int]]) -> int:
    """Ranks a hostfile has room for: the sum of its slots, the largest ``-np`` without oversubscribing."""
    return sum(slots for _, slots in entries)
