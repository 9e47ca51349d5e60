"""Forming torch.distributed's default process group, or adopting one a script formed itself.

:func:`ddpkit.init` (:mod:`ddpkit.distributed`) calls :func:`form_process_group`:
one worker gets a store in memory; several form the group on a TCP store at
MASTER_ADDR:MASTER_PORT that rank 0 serves on the address it reaches the
master from (:mod:`ddpkit.served_store`), or, under torchrun's agent, under
keys of this round of workers only (:mod:`ddpkit.round_store`). A group that
cannot form is one line naming the rank, the master and the fix. A group the
script formed first is checked against the launcher's variables
(:func:`environment_of_existing_group`, :func:`existing_backend`).
"""

from __future__ import annotations

import socket
import time
from collections.abc import Mapping, MutableMapping
from datetime import timedelta
from typing import Any

import torch.distributed as dist

# The stores' home: torch.distributed re-exports them without listing them, so the type checker misses them there.
from torch._C._distributed_c10d import HashStore, Store, TCPStore

from ddpkit import round_store
from ddpkit.env.base import JobEnvironment
from ddpkit.env.network import gloo_interface_environ
from ddpkit.env.torchrun import uses_agent_store
from ddpkit.errors import UserError


def environment_of_existing_group(env: JobEnvironment) -> JobEnvironment:
    """``env`` checked against the default group that already exists, or built from it without a launcher."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if (env.rank, env.world_size) == (rank, world_size):
        return env
    if env.source != "local":
        raise UserError(
            f"the existing process group makes this process rank {rank} of {world_size}, but {env.source}'s "
            f"variables say rank {env.rank} of {env.world_size}; form the group from the same variables "
            f"(init_method='env://'), or let ddpkit.init() form it"
        )
    # No launcher: the script formed the group itself. Ranks sharing a host name share a node.
    hosts: list[str] = [""] * world_size
    dist.all_gather_object(hosts, socket.gethostname())
    nodes = list(dict.fromkeys(hosts))
    host = hosts[rank]
    return JobEnvironment(
        source="torch.distributed",
        rank=rank,
        local_rank=hosts[:rank].count(host),
        world_size=world_size,
        local_world_size=hosts.count(host),
        node_rank=nodes.index(host),
        num_nodes=len(nodes),
        master_addr=env.master_addr,  # unused: the group exists; kept as the environment reports it
        master_port=env.master_port,
    )


def existing_backend(requested: str) -> str:
    """The backend of the existing default group, checked against ``requested``."""
    backend = dist.get_backend()
    if requested not in ("auto", backend):
        raise UserError(f"backend={requested!r} but the existing process group uses {backend!r}; pass backend=auto")
    return backend


def form_process_group(
    env: JobEnvironment, backend: str, timeout: float, environ: MutableMapping[str, str], options: Mapping[str, Any]
) -> None:
    """Form the default group; ``options`` are :func:`ddpkit.distributed.process_group_options`'s."""
    if env.world_size == 1:
        # One worker needs no network: a store in memory keeps collectives callable.
        dist.init_process_group(
            backend, store=HashStore(), rank=0, world_size=1, timeout=timedelta(seconds=timeout), **options
        )
        return
    if "gloo" in backend:
        environ.update(gloo_interface_environ(environ, env.master_addr))
    environ.update(
        MASTER_ADDR=env.master_addr,
        MASTER_PORT=str(env.master_port),
        RANK=str(env.rank),
        WORLD_SIZE=str(env.world_size),
        LOCAL_RANK=str(env.local_rank),
    )
    started = time.monotonic()
    try:
        if uses_agent_store(environ):
            # The agent's store outlives a round of workers: form the group under keys of this round only.
            store = round_store.round_store(environ, env.rank, env.world_size, timedelta(seconds=timeout))
        else:
            store = job_store(env, timedelta(seconds=timeout))
        dist.init_process_group(
            backend,
            store=store,
            rank=env.rank,
            world_size=env.world_size,
            timeout=timedelta(seconds=timeout),
            **options,
        )
    except (RuntimeError, OSError, dist.DistNetworkError, dist.DistStoreError) as e:
        raise RuntimeError(explain_init_failure(env, time.monotonic() - started, timeout, e)) from e


def job_store(env: JobEnvironment, timeout: timedelta) -> Store:
    """The store the group forms on, at MASTER_ADDR:MASTER_PORT: rank 0 serves it, the others are its clients.

    What ``init_method="env://"`` does, except that rank 0's store listens on
    the address it reaches MASTER_ADDR from only (:mod:`ddpkit.served_store`),
    not on every address of its host: nothing else of the network can write
    the keys the ranks read.
    """
    if env.rank != 0:
        return TCPStore(env.master_addr, env.master_port, env.world_size, is_master=False, timeout=timeout)
    from ddpkit.served_store import serve_at_master

    try:
        served = serve_at_master(
            env.master_addr, env.master_port, timeout, single_host=env.is_single_node, num_clients=env.world_size
        )
    except OSError:
        # The port is taken: by a store this process serves already (``ddpkit doctor``'s, multi-tenant as
        # env://'s is), which torch's store then shares, or by another process, which it reports.
        return TCPStore(
            env.master_addr, env.master_port, env.world_size, is_master=True, timeout=timeout, multi_tenant=True
        )
    assert served.store is not None
    return served.store  # the server lives as long as its own client, which the group holds


def explain_init_failure(env: JobEnvironment, waited: float, timeout: float, error: Exception) -> str:
    """The one line for a group that did not form: this rank, the master, torch's reason and the fix."""
    text = str(error).splitlines()[0] if str(error) else type(error).__name__
    where = f"{env.master_addr}:{env.master_port}"
    after = f"after {waited:.0f}s (timeout={timeout:g}s)"  # a refused connection may end long before the timeout
    if "address already in use" in text.lower() or "EADDRINUSE" in text:
        fix = f"port {env.master_port} is taken on the master; set MASTER_PORT to a free port"
    elif env.rank == 0:
        fix = f"not every one of the {env.world_size} workers joined {after}; check that all were started"
    else:
        fix = f"could not reach the master at {where} {after}; check that rank 0 runs and the address routes here"
    return f"rank {env.rank}/{env.world_size} could not join the process group at {where} ({env.source}): {text}; {fix}"
