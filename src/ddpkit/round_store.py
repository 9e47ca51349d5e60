"""The store a round of torchelastic workers forms its group on: fresh keys, although the agent's store is not.

Under torchrun the workers' process group is built on the store of the
launcher's agent (``TORCHELASTIC_USE_AGENT_STORE=True``: c10d rendezvous by
default, static rendezvous always). That store lives as long as the agent,
across restarts, and ``init_process_group(init_method="env://")`` writes the
same keys in every round: gloo's addresses (``default_pg/0//cpu//rank_0``...),
and ddpkit's own. A restarted worker that reads a key before its peer of the
new round wrote it gets the dead round's value: gloo connects to a port no
process has (``Gloo connectFullMesh failed ... Connection refused``) or to
one a new process happens to have (a hang). This is pytorch/pytorch#135712;
a plain DDP script fails in about half of its restarts.

``TORCHELASTIC_RESTART_COUNT`` does not tell rounds apart: torch's agents
count only their own failures, so in a job of several nodes one node's
restarted workers say 1 and the other's say 0 (measured with two agents of
one c10d rendezvous), and an agent restarts with the same count when nodes
join. Rank 0 of each round therefore makes a token and the round forms its
group under ``ddpkit/<run id>/<token>/``. The token is handed over through
the agent's store in a way a dead round cannot answer::

    rank 0 (new)                              rank r (new)
      token = uuid4                             nonce = uuid4
      set  ddpkit/<run>/token = token           t = get ddpkit/<run>/token      (maybe the dead round's)
      for each r:                               set  t/hello/<r> = nonce
        n = get token/hello/<r>  (blocks)       look for t/welcome/<nonce> for 1 s; none: read t again
        set token/welcome/<n>

Only a live rank 0 answers a hello, and only under its own token; the
nonce is new in every process, so no welcome of an earlier round matches.
All workers of a round start after the agents stopped the round before, so
a stale token has nobody to answer it. (Two agents of one c10d job on one
host, their workers restarted with counts 0 and 1: 3 of 3 restarts joined.)
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping
from datetime import timedelta

import torch.distributed as dist

# The stores' home: torch.distributed re-exports them without listing them, so the type checker misses them there.
from torch._C._distributed_c10d import PrefixStore, Store, TCPStore

WELCOME_WAIT = 1.0
"""Seconds a worker waits for rank 0's answer under a token before reading the token again."""
POLL = 0.01
"""Seconds between two looks for the answer (``check``: a timed-out ``wait`` would leave its answer in the socket)."""


def round_store(environ: Mapping[str, str], rank: int, world_size: int, timeout: timedelta) -> Store:
    """The agent's store (MASTER_ADDR:MASTER_PORT) under a prefix that only this round of workers uses.

    Collective: every rank of the round calls it.

    Raises:
        DistStoreError: rank 0 of the round did not hand over its token within ``timeout``.
    """
    agent_store = TCPStore(
        environ["MASTER_ADDR"], int(environ["MASTER_PORT"]), world_size, is_master=False, timeout=timeout
    )
    base = f"ddpkit/{environ.get('TORCHELASTIC_RUN_ID', '')}"
    deadline = time.monotonic() + timeout.total_seconds()
    token = _hand_out(agent_store, base, world_size) if rank == 0 else _take(agent_store, base, rank, deadline)
    return PrefixStore(f"{base}/{token}", agent_store)


def _hand_out(store: Store, base: str, world_size: int) -> str:
    """Rank 0: publish a new token and welcome each rank's hello under it; return the token."""
    token = uuid.uuid4().hex
    store.set(f"{base}/token", token)
    for rank in range(1, world_size):
        nonce = store.get(f"{base}/{token}/hello/{rank}").decode()  # blocks up to the store's timeout
        store.set(f"{base}/{token}/welcome/{nonce}", "")
    return token


def _take(store: Store, base: str, rank: int, deadline: float) -> str:
    """Rank r > 0: the token that a live rank 0 answers this process's hello under."""
    nonce = uuid.uuid4().hex
    while True:
        token = store.get(f"{base}/token").decode()  # blocks until a rank 0, of this round or one before, wrote it
        store.set(f"{base}/{token}/hello/{rank}", nonce)
        give_up = time.monotonic() + WELCOME_WAIT
        while time.monotonic() < give_up:
            if store.check([f"{base}/{token}/welcome/{nonce}"]):
                return token
            time.sleep(POLL)
        if time.monotonic() > deadline:
            raise dist.DistStoreError(
                f"rank 0 of this round did not answer rank {rank}'s hello through the launcher's store"
            )
