"""The options of a launch of local workers from the command line: :class:`LaunchOptions`, declared once.

``ddpkit train``'s TrainConfig and ``ddpkit run``'s RunConfig both extend it, so both commands take the same
words (``nproc``, the nodes, the port, restarts, the ranks shown), with the same help and the same checks.
No torch: ``ddpkit train --help`` and ``ddpkit run --help`` read this module.
"""

from __future__ import annotations

import dataclasses

from ddpkit.keyvalue import ConfigError, check_counts, check_positive, option

SHOW_RANKS_DEFAULT = "0"
"""The workers whose output ``ddpkit train`` and ``ddpkit run`` show: rank 0 (docs/guides/launching.md)."""


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


@dataclasses.dataclass
class LaunchOptions:
    """Where and how many workers a command starts, and what its console shows; set as key=value.

    A command's config extends it (its fields come first); its checks run once, in ``__post_init__``.
    """

    nproc: int = option(1, help="Workers to start on this machine.", group="distributed", counted=True)
    max_restarts: int = option(
        0,
        help="Times all workers are restarted after one fails (ddpkit train, and a script with a "
        "ddpkit.Checkpointer, continue from the latest checkpoint); nproc workers here only.",
        group="distributed",
        counted=True,
    )
    master_port: int = option(
        0,
        help="Rendezvous port on node 0; 0 asks the OS for a free one (one node only: nnodes > 1 needs a port).",
        group="distributed",
    )
    nnodes: int = option(
        1,
        help="Machines (or containers) of the job, each running this command with its node_rank.",
        group="distributed",
        counted=True,
    )
    node_rank: int = option(0, help="This machine's index among the nnodes, 0 on the master.", group="distributed")
    master_addr: str = option(
        "",
        help="With nnodes > 1: host name or address of node 0 (e.g. its container name), the same on every node.",
        group="distributed",
    )
    show_ranks: str = option(
        SHOW_RANKS_DEFAULT,
        help="Workers whose output this console shows, each line prefixed [rank r/w]: 0 (rank 0, which speaks for "
        "the run), a list (0,1) or all (as torchrun's --local-ranks-filter, by global rank); every rank's whole "
        "stdout and stderr are in the launch's log folder either way (rank-N.stdout.log, rank-N.stderr.log): "
        "<output_dir>/logs/<date-time>/ for ddpkit train, log_dir for ddpkit run.",
        group="output",
    )

    def __post_init__(self) -> None:
        check_positive("nproc", self.nproc)
        check_positive("max_restarts", self.max_restarts, allow_zero=True)
        check_counts(self)
        check_nodes(self.nnodes, self.node_rank, self.master_addr, self.master_port)
        shown_ranks(self.show_ranks)


LAUNCH_OPTIONS = tuple(field.name for field in dataclasses.fields(LaunchOptions))
"""The names of the launch options, in declaration order."""
