"""The rendezvous of an elastic job (``nnodes=MIN:MAX``): torch's dynamic rendezvous on one store.

``ddpkit run``/``ddpkit train`` with ``nnodes=MIN:MAX`` meet as ``torchrun
--nnodes=MIN:MAX --rdzv-backend=c10d --rdzv-endpoint=A:P`` does: every
node runs the same command, without a node rank; the agents agree on the
ranks in rounds, through a TCPStore at ``master_addr:master_port``::

    host A (a node, or a machine that stays: `ddpkit store port=P`)
      rendezvous store  A:P  <- every node's agent (never the workers)
    each round: the agent of group rank 0 names its address and a free port;
      its rank 0 worker serves the round's store there (``ddpkit.init``)

A node whose address is A serves the store (on A only, not on every
address as torch's does); any other node, or a node that finds the port
taken (by ``ddpkit store``, or by another launcher on the same host), is a
client. What torch's agents do with it, unchanged:

- a node lost: the survivors' workers fail at their next collective (gloo
  sees the closed connection; a node whose network vanished is seen at
  the collective timeout), each survivor's agent counts a failed round
  (:func:`restarts`), and the next rendezvous completes without the lost
  node, after :attr:`~ddpkit.launchers.local.LaunchSpec.rdzv_last_call`
  seconds once MIN nodes are there;
- a node that joins waits at the rendezvous; the running agents see it
  waiting, stop their workers (SIGTERM: a ddpkit.Checkpointer writes a
  checkpoint on it) and meet it in a new round, which costs no restart.
  Before that SIGTERM, ddpkit's agent writes
  :data:`ddpkit.distributed.NODES_JOINING` where the workers read the
  nodes' changes, so that rank 0 says a node is joining, not that the job
  was preempted.

ddpkit adds the node's names: each agent writes its address into each
round's keys and reads the others'; a change from the round before
("node 10.0.0.2 left") is written to a file named by
:data:`ddpkit.distributed.NODES_CHANGED_VARIABLE`, from which rank 0 says,
in one line once it has resumed, ``node X left; continuing on K nodes, W
workers, from step S``. The loss of the store itself ends every agent:
:class:`StoreLost`, one line.
"""

from __future__ import annotations

import collections
import ipaddress
import os
import socket
from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import Any

# TCPStore's home: torch.distributed re-exports it without listing it, so the type checker misses it there.
from torch._C._distributed_c10d import Store, TCPStore
from torch.distributed.elastic.rendezvous import (
    RendezvousConnectionError,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    rendezvous_handler_registry,
)
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

from ddpkit.distributed import NODES_CHANGED_VARIABLE
from ddpkit.env.network import source_address_for
from ddpkit.errors import UserError
from ddpkit.launchers.torch_internals import parse_rendezvous_endpoint
from ddpkit.served_store import ServedStore, listen_address

BACKEND = "ddpkit-elastic"
"""The rendezvous backend name to pass as ``rdzv_backend``; its endpoint: the store's ``host:port``."""
KEEP_ALIVE_INTERVAL_S = 1
"""Seconds between two heartbeats of each agent in the rendezvous store."""
KEEP_ALIVE_MAX_ATTEMPTS = 5
"""Heartbeats an agent may miss before the others take its node for gone (5 s: a node SIGKILLed is seen sooner
by its peers' collectives; a busy agent's heartbeat thread still beats within it)."""
NODE_KEY = "ddpkit/node/"
"""Prefix of the keys (in each round's part of the store) under which each agent writes its node's name."""


class StoreLost(RuntimeError):
    """The rendezvous store of an elastic job stopped answering: its host left, or it was stopped."""

    def __init__(self, endpoint: str):
        self.endpoint = endpoint
        super().__init__(
            f"the rendezvous store at {endpoint} is gone (its host left the job or it was stopped), and an elastic "
            "job cannot go on without it; the workers here were stopped (resume from the newest checkpoint by "
            "running the same command again): serve the store on a machine that stays up, e.g. `ddpkit store "
            "port=P` on a login node, and point master_addr there"
        )


def restarts(max_restarts: int, min_nodes: int, max_nodes: int) -> int:
    """The failed rounds torch's agent may restart in an elastic job: ``max_restarts`` + MAX - MIN.

    torch's agent restarts a round only while it has restarts left, and it
    counts the round that failed when a node left; ddpkit's agent gives that
    restart back once the rendezvous shows a node fewer
    (:class:`~ddpkit.launchers.torch_internals.HookedAgent`), so a job of
    ``max_restarts=0`` still needs one in hand: MAX - MIN of them.
    """
    return max_restarts + max_nodes - min_nodes


def run_id(rdzv_id: str, master_addr: str, master_port: int, environ: Mapping[str, str]) -> str:
    """The job's name in the store: ``rdzv_id``, else $SLURM_JOB_ID, else one made of the endpoint."""
    return rdzv_id or environ.get("SLURM_JOB_ID", "") or f"ddpkit-{master_addr}-{master_port}"


def elastic_rendezvous(
    master_addr: str, master_port: int, nodes: tuple[int, int], rdzv_id: str, last_call: float, timeout: float
) -> dict[str, Any]:
    """This machine's part in an elastic job of ``nodes`` (MIN, MAX): torch's LaunchConfig fields of the
    dynamic rendezvous, its store at ``master_addr:master_port``."""
    local_addr = source_address_for(master_addr)
    if local_addr is None:
        raise UserError(
            f"master_addr={master_addr} does not resolve on this node or no route leads to it; pass the "
            "host name or address of the rendezvous store's host, as every node reaches it"
        )
    register()
    return dict(
        min_nodes=nodes[0],
        max_nodes=nodes[1],
        run_id=run_id(rdzv_id, master_addr, master_port, os.environ),
        rdzv_backend=BACKEND,
        rdzv_endpoint=f"{master_addr}:{master_port}",
        rdzv_configs={
            "join_timeout": int(timeout),
            "last_call_timeout": last_call,
            "timeout": int(timeout),
            # A node that left is dropped from the rendezvous once its agent missed this many heartbeats: the
            # survivors' next round waits that long for it (torch's default: 3 of every 5 s, 15 s).
            "keep_alive_interval": KEEP_ALIVE_INTERVAL_S,
            "keep_alive_max_attempt": KEEP_ALIVE_MAX_ATTEMPTS,
        },
        # The address the other nodes' workers reach this one at, when its agent is group rank 0 (torch would
        # take the host name, which names loopback on many hosts).
        local_addr=local_addr,
    )


class ElasticRendezvousHandler(RendezvousHandler):
    """torch's dynamic rendezvous handler that also tells, at each round, which nodes left or joined."""

    def __init__(self, inner: RendezvousHandler, served: ServedStore | None, name: str, endpoint: str):
        self._inner = inner
        self._served = served  # held: the store serves as long as this handler
        self._name = name
        self._endpoint = endpoint
        self._names: list[str] | None = None

    def next_rendezvous(self) -> RendezvousInfo:
        """Join the next round (torch's handler); write down which nodes left or joined since the round before."""
        try:
            info = self._inner.next_rendezvous()
            names = _exchange_names(info.store, self._name, info.rank, info.world_size)
        except (RendezvousConnectionError, RuntimeError, OSError) as e:
            raise self._lost_or(e) from e
        if self._names is not None:
            write_nodes_change(nodes_change(self._names, names))
        self._names = names
        return info

    def _lost_or(self, error: BaseException) -> BaseException:
        """:class:`StoreLost` when ``error`` comes from a store that stopped answering, else ``error``."""
        if isinstance(error, RendezvousConnectionError):
            return StoreLost(self._endpoint)
        text = str(error)
        lost = ("connection to the C10d store has failed", "Connection reset", "Broken pipe", "Connection refused")
        return StoreLost(self._endpoint) if any(word in text for word in lost) else error

    @property
    def use_agent_store(self) -> bool:
        """False: each round's rank 0 worker serves the round's store (a fresh one every round)."""
        return False

    def get_backend(self) -> str:
        """The backend's name."""
        return BACKEND

    def is_closed(self) -> bool:
        """Whether the rendezvous is closed (torch's handler)."""
        try:
            return self._inner.is_closed()
        except (RendezvousConnectionError, RuntimeError) as e:
            raise self._lost_or(e) from e

    def set_closed(self) -> None:
        """Close the rendezvous (torch's handler)."""
        self._inner.set_closed()

    def num_nodes_waiting(self) -> int:
        """Nodes waiting to join the next round (torch's handler), asked while the workers run."""
        try:
            return self._inner.num_nodes_waiting()
        except (RendezvousConnectionError, RuntimeError) as e:
            raise self._lost_or(e) from e

    def get_run_id(self) -> str:
        """The run id (torch's handler)."""
        return self._inner.get_run_id()

    def shutdown(self) -> bool:
        """End the rendezvous (torch's handler); a store served here stops with the launcher."""
        try:
            return self._inner.shutdown()
        except (RendezvousConnectionError, RuntimeError):  # the store is gone already: nothing left to close
            return False


def _exchange_names(store: Store, name: str, rank: int, world_size: int) -> list[str]:
    """Every node's name by group rank: each agent of the round writes its own and reads the others'."""
    store.set(f"{NODE_KEY}{rank}", name)
    return [store.get(f"{NODE_KEY}{other}").decode() for other in range(world_size)]


def nodes_change(before: Sequence[str], after: Sequence[str]) -> str:
    """'node B left', 'nodes B, C joined', 'node B left and node C joined', or '' when the nodes are the same."""
    left = list((collections.Counter(before) - collections.Counter(after)).elements())
    joined = list((collections.Counter(after) - collections.Counter(before)).elements())
    parts = [
        f"{'node' if len(names) == 1 else 'nodes'} {', '.join(sorted(names))} {verb}"
        for names, verb in ((left, "left"), (joined, "joined"))
        if names
    ]
    return " and ".join(parts)


def write_nodes_change(change: str) -> None:
    """Put ``change`` where this launch's workers read it (nothing outside a ddpkit launch)."""
    path = os.environ.get(NODES_CHANGED_VARIABLE)
    if path:
        with open(path, "w", encoding="utf-8") as file:
            file.write(change)


def _serves_here(host: str) -> bool:
    """Whether ``host`` (the endpoint's) is an address of this machine: then this node serves the store."""
    address = source_address_for(host)
    try:
        resolved = socket.gethostbyname(host)
    except OSError:
        return False
    return address is not None and (address == resolved or ipaddress.ip_address(resolved).is_loopback)


def _open_store(host: str, port: int, timeout: timedelta) -> tuple[Store, ServedStore | None]:
    """The rendezvous store: served here when ``host`` is this machine's and the port is free, else a client."""
    if _serves_here(host):
        try:
            served = ServedStore(listen_address(host, single_host=False), port, timeout)
            assert served.store is not None
            return served.store, served
        except OSError:  # taken: `ddpkit store`, or another node's launcher on this machine, serves it
            pass
    # (torch.distributed re-exports TCPStore from its C extension without listing it in __all__)
    return TCPStore(host, port, None, False, timeout), None


def _create_handler(params: RendezvousParameters) -> RendezvousHandler:
    host, port = parse_rendezvous_endpoint(params.endpoint, default_port=-1)
    assert port != -1, params
    timeout = timedelta(seconds=params.get_as_int("timeout", 600) or 600)
    try:
        store, served = _open_store(host, port, timeout)
    except RuntimeError as e:
        raise UserError(
            f"no rendezvous store answers at {host}:{port} ({str(e).splitlines()[0]}); start the job's first node "
            f"with master_addr={host} there, or `ddpkit store port={port}` on {host}"
        ) from None
    inner = create_handler(store, C10dRendezvousBackend(store, params.run_id), params)
    name = params.local_addr or socket.gethostname()
    return ElasticRendezvousHandler(inner, served, name, f"{host}:{port}")


def register() -> None:
    """Make :data:`BACKEND` known to torch's rendezvous registry (once per process)."""
    rendezvous_handler_registry.register(BACKEND, _create_handler)
