"""The options of a launch from the command line (``ddpkit train``, ``ddpkit run``): their checks.

No torch: ``ddpkit train --help`` and ``ddpkit run --help`` read this module.
"""

from __future__ import annotations

from ddpkit.keyvalue import ConfigError, check_positive

SHOW_RANKS_DEFAULT = "0"
"""The workers whose output ``ddpkit train`` and ``ddpkit run`` show: rank 0 (README, "Your own script")."""


def shown_ranks(show_ranks: str) -> frozenset[int] | None:
    """The ranks ``show_ranks`` names: None for ``all``, else the comma-separated ranks (``0``, ``0,2``).

    Raises:
        ConfigError: anything else.
    """
    text = show_ranks.strip().lower()
    if text == "all":
        return None
    words = [word.strip() for word in text.split(",")]
    if not all(word.isdigit() for word in words):
        raise ConfigError(
            f"show_ranks={show_ranks!r} is not valid; use show_ranks=all, one rank (show_ranks=0) "
            "or a list (show_ranks=0,1)"
        )
    return frozenset(int(word) for word in words)


def describe_ranks(ranks: frozenset[int] | None) -> str:
    """'rank 0', 'ranks 0, 2' or 'every rank': what the console shows, for the lines that say so."""
    if ranks is None:
        return "every rank"
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, sorted(ranks)))


def check_port(master_port: int) -> None:
    """Raise ConfigError unless ``master_port`` is a TCP port or 0 (a free one)."""
    if not 0 <= master_port <= 65535:
        raise ConfigError(f"master_port={master_port} is not a TCP port; use 1-65535, or 0 for a free one")


def check_nodes(nnodes: int, node_rank: int, master_addr: str, master_port: int) -> None:
    """Raise ConfigError unless the options of a launch on ``nnodes`` machines fit together."""
    check_positive("nnodes", nnodes)
    check_port(master_port)
    if not 0 <= node_rank < nnodes:
        raise ConfigError(
            f"node_rank={node_rank} is not valid for nnodes={nnodes}; use 0 to {nnodes - 1}, 0 on the master"
        )
    if nnodes > 1 and not master_addr:
        raise ConfigError(
            f"nnodes={nnodes} needs master_addr=HOST, the host name or address of node 0 (its "
            "container name in a container network), the same on every node"
        )
    if nnodes > 1 and not master_port:
        raise ConfigError(
            f"nnodes={nnodes} needs master_port=PORT, a free TCP port on node 0, the same on every "
            "node (e.g. master_port=29500)"
        )
