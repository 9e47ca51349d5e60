"""The rendezvous of ``ddpkit run`` and ``ddpkit train nproc=N``: loopback only, a fresh store each round.

torch's c10d rendezvous hosts its TCPStore on every interface, whatever
address it is given (the server binds the wildcard address), and so does
the store that rank 0 of each round hosts for the workers' process group.
The store has no authentication (torch's SECURITY.md: the distributed
features assume a trusted network): anything that can reach the port can
write keys the workers read. On one machine nothing outside it needs to
reach either store, so this backend (:data:`BACKEND`, registered with
torch's rendezvous registry) listens on ``127.0.0.1`` only:

- the rendezvous store is a TCPStore served from a socket ddpkit bound to
  ``127.0.0.1`` (``master_listen_fd``: :mod:`ddpkit.served_store`),
  kept by the launcher;
- each round of workers (the first, and each restart) gets a new TCPStore,
  also on ``127.0.0.1`` and kept by the launcher, as ``MASTER_ADDR`` and
  ``MASTER_PORT``; the workers are its clients (``TORCHELASTIC_USE_AGENT_STORE``).
  The store of the round before is closed first, so a restarted round never
  reads the keys of the dead one: gloo addresses of processes that are gone
  (pytorch/pytorch#135712) or a barrier count that is already complete.

The rendezvous itself (who joins, ranks, restarts) is torch's dynamic
handler, unchanged::

    launcher (agent)                                workers of round r
      rendezvous store  127.0.0.1:P  <- agent only
      round-r store     127.0.0.1:Q  <- MASTER_ADDR=127.0.0.1 MASTER_PORT=Q (all clients)

Gloo's own pair sockets bind the address of the interface gloo is given;
for a single-node job ddpkit.init gives it loopback.
"""

from __future__ import annotations

from datetime import timedelta

from torch.distributed.elastic.rendezvous import (
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStoreInfo,
    rendezvous_handler_registry,
)
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

from ddpkit.launchers.torch_internals import parse_rendezvous_endpoint
from ddpkit.served_store import ServedStore

BACKEND = "ddpkit-loopback"
"""The rendezvous backend name to pass as ``rdzv_backend`` (its endpoint: ``127.0.0.1:PORT``)."""
LOOPBACK = "127.0.0.1"


class LoopbackRendezvousHandler(RendezvousHandler):
    """torch's dynamic rendezvous over a loopback store; each round's workers get a fresh loopback store."""

    def __init__(self, inner: RendezvousHandler, rendezvous_store: ServedStore, timeout: timedelta):
        self._inner = inner
        self._rendezvous_store = rendezvous_store
        self._timeout = timeout
        self._round_store: ServedStore | None = None

    def next_rendezvous(self) -> RendezvousInfo:
        """Join the next round (torch's handler), then open this round's store for the workers."""
        info = self._inner.next_rendezvous()
        self._close_round_store()  # the workers of the round before are stopped: none reads it again
        self._round_store = ServedStore(LOOPBACK, 0, self._timeout)
        return RendezvousInfo(
            info.store, info.rank, info.world_size, RendezvousStoreInfo(LOOPBACK, self._round_store.port)
        )

    @property
    def use_agent_store(self) -> bool:
        """True: the workers are clients of the round's store, which the launcher serves."""
        return True

    def get_backend(self) -> str:
        """The backend's name."""
        return BACKEND

    def is_closed(self) -> bool:
        """Whether the rendezvous is closed (torch's handler)."""
        return self._inner.is_closed()

    def set_closed(self) -> None:
        """Close the rendezvous (torch's handler)."""
        self._inner.set_closed()

    def num_nodes_waiting(self) -> int:
        """Nodes waiting to join the next round (torch's handler)."""
        return self._inner.num_nodes_waiting()

    def get_run_id(self) -> str:
        """The run id (torch's handler)."""
        return self._inner.get_run_id()

    def shutdown(self) -> bool:
        """End the rendezvous and stop both stores."""
        done = self._inner.shutdown()
        self._close_round_store()
        return done

    def _close_round_store(self) -> None:
        if self._round_store is not None:
            self._round_store.close()
            self._round_store = None


def _create_handler(params: RendezvousParameters) -> RendezvousHandler:
    host, port = parse_rendezvous_endpoint(params.endpoint, default_port=0)
    if host != LOOPBACK:
        raise ValueError(f"the {BACKEND} rendezvous serves {LOOPBACK} only, not {host!r}")
    timeout = timedelta(seconds=params.get_as_int("read_timeout", 60) or 60)
    rendezvous_store = ServedStore(LOOPBACK, port, timeout)
    store = rendezvous_store.store
    assert store is not None
    inner = create_handler(store, C10dRendezvousBackend(store, params.run_id), params)
    return LoopbackRendezvousHandler(inner, rendezvous_store, timeout)


def register() -> None:
    """Make :data:`BACKEND` known to torch's rendezvous registry (once per process)."""
    rendezvous_handler_registry.register(BACKEND, _create_handler)  # registering the same creator again is a no-op
