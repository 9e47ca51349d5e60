"""``ddpkit store``: the rendezvous store of elastic jobs, served alone on a machine that stays up.

::

    login1$ ddpkit store port=29500
    nodeN$  ddpkit run nproc=4 nnodes=1:8 master_addr=login1 master_port=29500 train.py

An elastic job (``nnodes=MIN:MAX``) goes on when nodes leave, except the one
that serves its rendezvous store: every agent reads and writes it, so its
loss ends the job. Served here, on a login node or any machine outside the
job, the store outlives every node. Several jobs share one store, each under
its ``rdzv_id``. torch is imported only when the command runs.
"""

from __future__ import annotations

import dataclasses
import signal
import socket
import sys
from collections.abc import Sequence

from ddpkit.commands.help import CommandHelp
from ddpkit.keyvalue import ConfigError, option, parse


@dataclasses.dataclass
class StoreConfig:
    """Options of ``ddpkit store``."""

    port: int = option(0, help="The TCP port to serve on, the nodes' master_port (required).")
    host: str = option(
        "",
        help="The address to serve on, the nodes' master_addr (a host name or address of this machine); "
        "empty: every address of this machine.",
    )

    def __post_init__(self) -> None:
        if not 1 <= self.port <= 65535:
            raise ConfigError(
                f"port={self.port} is not valid; pass the TCP port the nodes give as master_port (e.g. port=29500)"
            )


STORE_HELP = CommandHelp(
    usage="ddpkit store port=P [host=ADDR]",
    summary="Serve the rendezvous store of elastic jobs (ddpkit run/train nnodes=MIN:MAX master_addr=THIS_HOST "
    "master_port=P) until stopped (Ctrl-C, SIGTERM), on a machine that stays up while nodes come and go: "
    "the job ends when the store's host goes, whichever node leaves otherwise.",
    schema="ddpkit.commands.store:StoreConfig",
    examples=(
        "ddpkit store port=29500",
        "ddpkit run nproc=4 nnodes=1:8 master_addr=login1 master_port=29500 train.py   # on each node",
    ),
    exit_statuses=(("0", "stopped by Ctrl-C or SIGTERM"), ("2", "bad input, or the port is taken: one line says so")),
)


def store_command(args: Sequence[str]) -> int:
    """``ddpkit store port=P [host=ADDR]``: serve a TCPStore until SIGINT or SIGTERM."""
    from datetime import timedelta

    from ddpkit.errors import UserError
    from ddpkit.served_store import WILDCARD, ServedStore, listen_address

    config = parse(StoreConfig, args)
    address = listen_address(config.host, single_host=False) if config.host else WILDCARD
    stop = {signal.SIGINT, signal.SIGTERM}
    signal.pthread_sigmask(signal.SIG_BLOCK, stop)  # taken by sigwait below, not by Python's handlers
    try:
        served = ServedStore(address, config.port, timedelta(hours=1))
    except OSError as e:
        raise UserError(
            f"cannot serve on {address}:{config.port} ({e.strerror}); choose another port, or stop what serves it"
        ) from None
    where = config.host or socket.gethostname()
    print(
        f"ddpkit store: serving the rendezvous store on {address}:{served.port}; start each node with "
        f"nnodes=MIN:MAX master_addr={where} master_port={served.port}; Ctrl-C stops it",
        file=sys.stderr,
        flush=True,
    )
    received = signal.sigwait(stop)
    served.close()
    print(f"ddpkit store: stopped by {signal.Signals(received).name}", file=sys.stderr, flush=True)
    return 0
