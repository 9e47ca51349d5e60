"""The options of a launch of local workers from the command line: :class:`LaunchOptions`, declared once.

``ddpkit train``'s TrainConfig and ``ddpkit run``'s RunConfig both extend it, so both commands take the same
words (``nproc``, the nodes, the port, restarts, the ranks shown), with the same help and the same checks.
No torch: ``ddpkit train --help`` and ``ddpkit run --help`` read this module.
"""

from __future__ import annotations

import dataclasses

from ddpkit.keyvalue import ConfigError, check_count, check_counts, check_positive, option

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


@dataclasses.dataclass(frozen=True)
class Nodes:
    """The machines of a job, as ``nnodes`` gives them: N (static) or MIN:MAX (elastic)."""

    min_nodes: int
    """The fewest nodes the job runs on."""
    max_nodes: int
    """The most nodes the job runs on."""
    elastic: bool
    """``nnodes=MIN:MAX``: torch's dynamic rendezvous, nodes may leave and join; else a static rendezvous."""


def parse_nodes(nnodes: str) -> Nodes:
    """The nodes of ``nnodes``: ``N`` (a static job of N nodes) or ``MIN:MAX`` (an elastic one), as torchrun's.

    Raises:
        ConfigError: anything else, or MIN > MAX.
    """
    words = [word.strip() for word in str(nnodes).split(":")]
    if len(words) > 2 or not all(word.isdigit() for word in words):
        raise ConfigError(
            f"nnodes={nnodes} is not valid; use nnodes=N (N nodes) or nnodes=MIN:MAX (elastic, e.g. nnodes=1:4)"
        )
    low, high = int(words[0]), int(words[-1])
    check_positive("nnodes", low)
    check_count("nnodes", high)
    if low > high:
        raise ConfigError(f"nnodes={nnodes} is not valid: MIN > MAX; use nnodes=MIN:MAX with MIN <= MAX (e.g. 1:4)")
    return Nodes(low, high, elastic=len(words) == 2)


def check_nodes(nnodes: str, node_rank: int, master_addr: str, master_port: int) -> None:
    """Raise ConfigError unless the options of a launch on ``nnodes`` machines fit together."""
    nodes = parse_nodes(nnodes)
    check_port(master_port)
    if nodes.elastic and node_rank:
        raise ConfigError(
            f"node_rank={node_rank} is not used with nnodes={nnodes}: the nodes of an elastic job agree on "
            "their ranks; leave node_rank out"
        )
    if not 0 <= node_rank < nodes.max_nodes:
        raise ConfigError(
            f"node_rank={node_rank} is not valid for nnodes={nnodes}; use 0 to {nodes.max_nodes - 1}, 0 on the master"
        )
    where = "the host of the rendezvous store" if nodes.elastic else "node 0"
    if (nodes.max_nodes > 1 or nodes.elastic) and not master_addr:
        raise ConfigError(
            f"nnodes={nnodes} needs master_addr=HOST, the host name or address of {where} (its "
            "container name in a container network), the same on every node"
        )
    if (nodes.max_nodes > 1 or nodes.elastic) and not master_port:
        raise ConfigError(
            f"nnodes={nnodes} needs master_port=PORT, a free TCP port on {where}, the same on every "
            "node (e.g. master_port=29500)"
        )


ELASTIC_RESTARTS_NOTE = (
    "with nnodes=MIN:MAX the workers also restart, at the new size, whenever a node leaves or joins, "
    "which costs no restart, and up to max_restarts + MAX - MIN failures of the workers themselves are restarted"
)
"""How an elastic launch counts restarts (torch's agent restarts a round a node left as a failed one)."""


@dataclasses.dataclass
class LaunchOptions:
    """Where and how many workers a command starts, and what its console shows; set as key=value.

    A command's config extends it (its fields come first); its checks run once, in ``__post_init__``.
    """

    nproc: int = option(1, help="Workers to start on this machine.", group="distributed", counted=True)
    max_restarts: int = option(
        0,
        help="Times all workers are restarted after one fails (ddpkit train, and a script with a "
        "ddpkit.Checkpointer, continue from the latest checkpoint); " + ELASTIC_RESTARTS_NOTE + ".",
        group="distributed",
        counted=True,
    )
    master_port: int = option(
        0,
        help="Rendezvous port on node 0; 0 asks the OS for a free one (one node only: nnodes > 1 needs a port).",
        group="distributed",
    )
    nnodes: str = option(
        "1",
        help="Machines (or containers) of the job: N, each running this command with its node_rank (static), or "
        "MIN:MAX (elastic, as torchrun's --nnodes=MIN:MAX): each node runs the same command, without node_rank; "
        "the job goes on while at least MIN nodes are there, nodes that leave are dropped and nodes that join "
        "are taken in, and the workers resume from the newest checkpoint at each change.",
        group="distributed",
    )
    node_rank: int = option(
        0, help="This machine's index among the nnodes, 0 on the master (static nnodes=N only).", group="distributed"
    )
    master_addr: str = option(
        "",
        help="With nnodes > 1: host name or address of node 0 (e.g. its container name), the same on every node; "
        "with nnodes=MIN:MAX, of the rendezvous store's host: a node that serves it when it is this address, or a "
        "machine that stays up running ddpkit store (the job ends if the store's host goes).",
        group="distributed",
    )
    rdzv_id: str = option(
        "",
        help="With nnodes=MIN:MAX: the job's name in the rendezvous store, the same on every node, so that jobs "
        "sharing one store do not meet; empty: $SLURM_JOB_ID when set, else ddpkit-MASTER_ADDR-MASTER_PORT.",
        group="distributed",
    )
    rdzv_last_call: float = option(
        30.0,
        help="With nnodes=MIN:MAX: seconds a rendezvous waits for more nodes once MIN are there (torch's "
        "last_call_timeout): the pause of a job that continues after a node left.",
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
        check_positive("rdzv_last_call", self.rdzv_last_call, allow_zero=True)
        shown_ranks(self.show_ranks)

    @property
    def nodes(self) -> Nodes:
        """The nodes ``nnodes`` names."""
        return parse_nodes(self.nnodes)


LAUNCH_OPTIONS = tuple(field.name for field in dataclasses.fields(LaunchOptions))
"""The names of the launch options, in declaration order."""
