"""The rendezvous of a job of several machines: torch's static rendezvous, node 0's store on one address.

``ddpkit run``/``ddpkit train`` with ``nnodes > 1`` meet as ``torchrun
--nnodes N --node-rank R --master-addr A --master-port P`` does: node 0's
agent hosts a TCPStore at port P, every node's agent and every worker is
its client, and nothing else is agreed on. torch's static rendezvous
serves that store on every address of node 0 (the server binds the
wildcard address). This backend (:data:`BACKEND`) is the same rendezvous,
with node 0's store served from a socket bound to one address
(:mod:`ddpkit.served_store`): the address node 0 reaches A from,
which is A itself when A is node 0's address, and the address of the
interface ``ddpkit.init`` gives gloo (the one that routes to the master,
:mod:`ddpkit.env.network`); every address only when A is a host name that
node 0 alone resolves to loopback (see :func:`ddpkit.served_store.listen_address`)::

    node 0   agent: store  A:P  <- every agent, and every worker of every round
             workers: gloo pairs on A's interface
    node r   agent: client of A:P
             workers: gloo pairs on the address of the interface that routes to A

The workers' process group is formed on that store under keys of its round
alone (:mod:`ddpkit.round_store`). The launcher checks the address and the
port before starting (:func:`ddpkit.served_store.listen_address`).
"""

from __future__ import annotations

from datetime import timedelta

import torch.distributed
from torch.distributed.distributed_c10d import PrefixStore, Store
from torch.distributed.elastic.rendezvous import (
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStoreInfo,
    rendezvous_handler_registry,
)

from ddpkit.launchers.torch_internals import parse_rendezvous_endpoint
from ddpkit.served_store import ServedStore

BACKEND = "ddpkit-static"
"""The rendezvous backend name to pass as ``rdzv_backend``; its configs: ``rank``, ``timeout``, ``listen_address``."""


class StaticRendezvousHandler(RendezvousHandler):
    """torch's static rendezvous (one round, ranks as given), node 0's store served on one address."""

    def __init__(self, params: RendezvousParameters, master_addr: str, master_port: int):
        self._master_addr = master_addr
        self._master_port = master_port
        self._rank = int(params.config["rank"])
        self._num_nodes = params.max_nodes
        self._run_id = params.run_id
        self._timeout = timedelta(seconds=int(params.config.get("timeout", 600)))
        self._listen_address = str(params.config.get("listen_address", ""))
        self._served: ServedStore | None = None
        self._store: Store | None = None

    def next_rendezvous(self) -> RendezvousInfo:
        """Open the store once (node 0 serves it, after every node connected), then the same info each time."""
        if self._store is None:
            self._store = self._open_store()
        return RendezvousInfo(
            PrefixStore(self._run_id, self._store),
            self._rank,
            self._num_nodes,
            RendezvousStoreInfo(self._master_addr, self._master_port),
        )

    def _open_store(self) -> Store:
        if self._rank == 0:
            self._served = ServedStore(self._listen_address, self._master_port, self._timeout, self._num_nodes)
            assert self._served.store is not None
            return self._served.store
        # (torch.distributed re-exports TCPStore from its C extension without listing it in __all__)
        return torch.distributed.TCPStore(  # type: ignore[attr-defined]
            self._master_addr, self._master_port, self._num_nodes, False, self._timeout
        )

    @property
    def use_agent_store(self) -> bool:
        """True: the workers are clients of node 0's store."""
        return True

    def get_backend(self) -> str:
        """The backend's name."""
        return BACKEND

    def is_closed(self) -> bool:
        """False: a static rendezvous is never closed (as torch's)."""
        return False

    def set_closed(self) -> None:
        """Nothing to close (as torch's)."""

    def num_nodes_waiting(self) -> int:
        """0: no node joins a static rendezvous later."""
        return 0

    def get_run_id(self) -> str:
        """The run id."""
        return self._run_id

    def shutdown(self) -> bool:
        """Nothing to end: node 0's store stops with the launcher, which the other agents leave first."""
        return True


def _create_handler(params: RendezvousParameters) -> RendezvousHandler:
    master_addr, master_port = parse_rendezvous_endpoint(params.endpoint, default_port=-1)
    assert master_port != -1 and "rank" in params.config, params
    if int(params.config["rank"]) == 0 and not params.config.get("listen_address"):
        raise ValueError(
            f"the {BACKEND} rendezvous needs listen_address on node 0 (see ddpkit.served_store.listen_address)"
        )
    return StaticRendezvousHandler(params, master_addr, master_port)


def register() -> None:
    """Make :data:`BACKEND` known to torch's rendezvous registry (once per process)."""
    rendezvous_handler_registry.register(BACKEND, _create_handler)
