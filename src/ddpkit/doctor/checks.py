"""Steps 1 to 4 of the doctor: reach the master, the roll call, join the process group, all_reduce.

Each step returns a passed Check or raises DoctorProblem with its diagnosis.
"""

from __future__ import annotations

import dataclasses
import json
import socket
import time
from collections.abc import Mapping, MutableMapping, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from ddpkit.doctor.config import DoctorConfig
from ddpkit.doctor.diagnoses import (
    join_diagnosis,
    loopback_diagnosis,
    missing_diagnosis,
    unreachable_diagnosis,
    unresolvable_diagnosis,
)
from ddpkit.doctor.results import Check, DoctorProblem, WorkerInfo
from ddpkit.env.base import JobEnvironment
from ddpkit.env.torchrun import uses_agent_store

if TYPE_CHECKING:
    # torch.distributed re-exports these without listing them; their home is the c10d extension.
    import torch
    from torch._C._distributed_c10d import PrefixStore, Store

    from ddpkit.distributed import Context

_PREFIX = "ddpkit-doctor/"
# Seconds one TCP connection attempt to the master may take before the next.
_CONNECT_ATTEMPT_SECONDS = 2.0
# Seconds (at most the timeout itself) rank 0 waits beyond the timeout for a missing worker.
# That worker may be trying to reach the master for the whole timeout, from a start a moment
# later than rank 0's: it then reports its own, more precise diagnosis (where it tried to
# connect) before rank 0 stops, and with rank 0 the job's launcher, which may stop the other
# workers before they print.
_ROLL_CALL_GRACE_SECONDS = 3.0


# -- 1. reach the master -----------------------------------------------------


def reach_master(env: JobEnvironment, timeout: float) -> Check:
    """Open (and close) a TCP connection to the master's port, retrying until timeout.

    Raises:
        DoctorProblem: no connection within timeout; the diagnosis names
            the address, the port, the error and what to check.
    """
    where = f"{env.master_addr}:{env.master_port}"
    start = time.monotonic()
    deadline = start + timeout
    while True:
        attempt = min(_CONNECT_ATTEMPT_SECONDS, max(deadline - time.monotonic(), 0.1))
        try:
            with socket.create_connection((env.master_addr, env.master_port), timeout=attempt):
                elapsed = time.monotonic() - start
                return Check("reach master", True, f"TCP connect to {where}", elapsed)
        except socket.gaierror as e:
            raise DoctorProblem("reach master", unresolvable_diagnosis(env, e)) from None
        except OSError as e:
            error = e
        if time.monotonic() >= deadline:
            raise DoctorProblem("reach master", unreachable_diagnosis(env, error, timeout), timeout)
        time.sleep(0.2)


# -- 2. roll call -------------------------------------------------------------


def open_store(env: JobEnvironment, environ: Mapping[str, str], timeout: float) -> tuple[Store, PrefixStore]:
    """The rendezvous store at the master, started by rank 0 unless torchrun's agent runs it.

    Rank 0's server listens on the address it reaches the master from only,
    as ``ddpkit.init``'s does (:mod:`ddpkit.served_store`), and is
    multi-tenant, as torch's env:// rendezvous makes it: ``ddpkit.init`` on
    rank 0 then reuses this server (same port, same process) instead of
    binding the port again, so the store stays up from the roll call to the
    process group.

    Raises:
        DoctorProblem: rank 0 cannot listen on the port, or a worker cannot open the store.
    """
    import torch.distributed as dist
    from torch._C._distributed_c10d import PrefixStore, TCPStore

    host = not uses_agent_store(environ) and env.rank == 0
    try:
        if host:
            from ddpkit.served_store import serve_at_master

            served = serve_at_master(
                env.master_addr,
                env.master_port,
                timedelta(seconds=timeout),
                single_host=env.is_single_node,
                multi_tenant=True,
            )
            assert served.store is not None  # open until closed
            store: Store = served.store  # the server lives as long as its own client
        else:
            store = TCPStore(
                env.master_addr, env.master_port, None, False, timedelta(seconds=timeout), wait_for_workers=False
            )
    except (OSError, RuntimeError, dist.DistNetworkError, dist.DistStoreError) as e:
        text = str(e).splitlines()[0] if str(e) else type(e).__name__
        if host and ("address already in use" in text.lower() or "EADDRINUSE" in text):
            raise DoctorProblem(
                "rendezvous store",
                f"rank 0 cannot listen on port {env.master_port}: it is taken on this host ({text}); "
                "set MASTER_PORT to a free port (the same on every worker)",
            ) from None
        raise DoctorProblem(
            "rendezvous store",
            f"rank {env.rank}/{env.world_size} cannot open the store at {env.master_addr}:{env.master_port}: {text}",
        ) from None
    prefix = _PREFIX
    if uses_agent_store(environ):
        # The agent's store outlives one run of the workers: keep restarts apart.
        prefix += f"{environ.get('TORCHELASTIC_RUN_ID', '')}/{environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
    return store, PrefixStore(prefix, store)


def roll_call(store: Store, me: WorkerInfo, env: JobEnvironment, timeout: float) -> tuple[list[WorkerInfo], Check]:
    """Every worker reports itself; rank 0 collects and judges, and tells everyone.

    Returns:
        Every worker's info by rank, and the check.

    Raises:
        DoctorProblem: a worker did not arrive within timeout, or the
            interfaces cannot connect the hosts (the same diagnosis on every rank).
    """
    start = time.monotonic()
    store.set(f"arrived/{me.rank}", json.dumps(dataclasses.asdict(me)))
    if env.rank == 0:
        outcome = _collect(store, env, timeout)
        store.set("roll", json.dumps(outcome))
        # Keep the store up until every worker that arrived has read the outcome:
        # on a problem rank 0 stops next, and its server with it.
        readers = [f"read/{w['rank']}" for w in outcome["workers"] if w["rank"] != 0]
        _wait_quietly(store, readers, timeout)
    else:
        try:
            store.wait(["roll"], timedelta(seconds=timeout + 10))  # rank 0 waits timeout itself first
        except (RuntimeError, TimeoutError) as e:
            raise DoctorProblem(
                "roll call",
                f"rank {env.rank}/{env.world_size} reached the store but rank 0 did not report the "
                f"roll call within {timeout + 10:g}s ({str(e).splitlines()[0]}); check rank 0's output",
            ) from None
        outcome = json.loads(store.get("roll"))
        store.set(f"read/{env.rank}", "1")
    workers = [WorkerInfo(**w) for w in outcome["workers"]]
    if outcome["problem"]:
        raise DoctorProblem("roll call", outcome["problem"], time.monotonic() - start)
    detail = f"{env.world_size} of {env.world_size} workers arrived, on {len({w.stack for w in workers})} host(s)"
    return workers, Check("roll call", True, detail, time.monotonic() - start)


def _wait_quietly(store: Store, keys: Sequence[str], timeout: float) -> None:
    """Wait up to timeout for keys; a worker that vanished meanwhile is not a second problem."""
    import torch.distributed as dist

    if keys:
        try:
            store.wait(list(keys), timedelta(seconds=timeout))
        except (RuntimeError, dist.DistError):
            pass


def _collect(store: Store, env: JobEnvironment, timeout: float) -> dict[str, Any]:
    keys = [f"arrived/{r}" for r in range(env.world_size)]
    deadline = time.monotonic() + timeout + min(timeout, _ROLL_CALL_GRACE_SECONDS)
    present: dict[int, WorkerInfo] = {}
    while True:
        for rank, key in enumerate(keys):
            if rank not in present and store.check([key]):
                present[rank] = WorkerInfo(**json.loads(store.get(key)))
        if len(present) == env.world_size or time.monotonic() >= deadline:
            break
        time.sleep(0.05)
    workers = [present[r] for r in sorted(present)]
    missing = [r for r in range(env.world_size) if r not in present]
    if missing:
        problem = missing_diagnosis(env, missing, workers, timeout)
    else:
        problem = loopback_diagnosis(env, workers)
    return {"workers": [dataclasses.asdict(w) for w in workers], "problem": problem}


# -- 3. and 4. the process group ----------------------------------------------


def join(
    cfg: DoctorConfig, env: JobEnvironment, environ: MutableMapping[str, str], workers: Sequence[WorkerInfo]
) -> tuple[Context, Check]:
    """``ddpkit.init`` with the doctor's timeout; returns the context.

    Raises:
        DoctorProblem: the process group did not form; gloo's own
            connection failures get the interface diagnosis.
    """
    from ddpkit import distributed

    start = time.monotonic()
    try:
        ctx = distributed.init(cfg.backend, cfg.device, cfg.timeout, environ=environ)
    except RuntimeError as e:
        diagnosis = join_diagnosis(env, str(e), workers)
        raise DoctorProblem("join process group", diagnosis, time.monotonic() - start) from None
    return ctx, Check("join process group", True, f"ddpkit.init, backend {ctx.backend}", time.monotonic() - start)


def probe_device(ctx: Context) -> torch.device:
    """The device of the doctor's tensors: the worker's own where its backend takes it, else the control device.

    With nccl (alone or in ``cpu:gloo,cuda:nccl``) the tensors sit on the
    worker's device, so that the doctor checks and measures the path the
    gradients take. Plain gloo sends CPU tensors only (its send/recv do not
    take CUDA ones), whatever device the worker trains on:
    :func:`ddpkit.distributed.control_device` decides.
    """
    from ddpkit.distributed import control_device

    return ctx.device if "nccl" in ctx.backend else control_device()


def sanity_all_reduce(ctx: Context, timeout: float) -> Check:
    """all_reduce of each rank's number: the sum must be n(n-1)/2.

    Raises:
        DoctorProblem: wrong sum, or the collective failed (a worker left).
    """
    import torch
    import torch.distributed as dist

    n = ctx.world_size
    expected = n * (n - 1) // 2
    start = time.monotonic()
    value = torch.tensor([float(ctx.rank)], device=probe_device(ctx))
    try:
        dist.all_reduce(value)
    except (RuntimeError, dist.DistError) as e:
        raise DoctorProblem(
            "all_reduce",
            f"rank {ctx.rank}/{n}: all_reduce failed within {timeout:g}s: "
            f"{str(e).splitlines()[0]}; a worker stopped or its network broke: check the other workers' output",
        ) from None
    got = value.item()
    if got != expected:
        raise DoctorProblem(
            "all_reduce", f"rank {ctx.rank}/{n}: all_reduce of the ranks gave {got:g}, expected {expected}"
        )
    return Check("all_reduce", True, f"sum of ranks {got:g} == {expected}", time.monotonic() - start)
