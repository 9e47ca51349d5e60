"""``ddpkit doctor``: what each worker sees, and whether the workers can reach each other.

Run it the way the training runs, as every worker of the job::

    ddpkit doctor                      # this process alone: environment, devices, how to run more
    ddpkit doctor nproc=2              # 2 workers on this machine
    torchrun --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d --rdzv-endpoint HOST:PORT -m ddpkit doctor
    srun --nodes 2 --ntasks-per-node 4 python -m ddpkit doctor
    mpirun -np 8 python -m ddpkit doctor

Every worker resolves its environment (``ddpkit.env``) and the network
interface gloo will use, then runs the checks in the order training depends
on them. The first check that fails ends the run with a diagnosis that says
what to check:

1. reach the master: a TCP connection to MASTER_ADDR:MASTER_PORT, retried
   until ``timeout`` (rank 0 may start later than the others). Rank 0 first
   starts the rendezvous store there, unless torchrun's agent already runs it.
2. roll call: each worker writes its host, interface and address into that
   store; rank 0 waits for all of them, names the ranks missing, and checks
   that no worker binds gloo to a loopback address that workers on another
   host cannot reach. Rank 0 shares the outcome, so every worker stops or
   goes on together.
3. join the process group with ``ddpkit.init`` (gloo connects every pair of
   workers here, over the chosen interfaces).
4. all_reduce sanity: the sum of the ranks is ``n(n-1)/2`` on every rank.
5. measure, between rank 0 and each peer in turn: latency (ping-pong of
   4 bytes; half the round trip, as OSU's benchmark reports it) and
   bandwidth (``bandwidth_mib`` MiB each way: bytes / half the round trip);
   and the latency of a 4-byte all_reduce over all workers.

Rank 0 prints the report (as JSON with ``json=true``); the other workers
print only their problems, on stderr. The exit status is 0 when every check
passed on this worker (with ``nproc``: on every worker).

::

    rank 0 (hosts the store)          rank 1..n-1
    bind MASTER_PORT, store up        connect MASTER_ADDR:MASTER_PORT (retry)
    roll call: wait for all  <------  set doctor/arrived/<rank>
    set doctor/roll  --------------->  read it: stop on a problem
    ddpkit.init  <------ gloo ------>  ddpkit.init
"""

from __future__ import annotations

import dataclasses
import errno
import ipaddress
import json
import os
import socket
import statistics
import sys
import time
from collections.abc import Mapping, MutableMapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from ddpkit.config import ConfigError, check_positive, parse
from ddpkit.env.base import ClusterEnvironment
from ddpkit.env.detect import detect_environment
from ddpkit.env.network import interface_addresses, interface_for

_PREFIX = "ddpkit-doctor/"
# Seconds one TCP connection attempt to the master may take before the next.
_CONNECT_ATTEMPT_SECONDS = 2.0
_WARMUP_ROUND_TRIPS = 3


@dataclass
class DoctorConfig:
    """Options of ``ddpkit doctor``; every field can be set as key=value."""

    json: bool = False
    """Print the report as one JSON document instead of text."""
    nproc: int = 1
    """Workers to start on this machine; ignored when started by torchrun, srun or mpirun."""
    master_port: int = 0
    """Rendezvous port for nproc > 1 on this machine; 0 asks the OS for a free one."""
    backend: str = "auto"
    """Process-group backend, as for training: auto, gloo, nccl or cpu:gloo,cuda:nccl."""
    device: str = "auto"
    """Device of the test tensors: auto, cpu or cuda."""
    timeout: float = 30.0
    """Seconds to reach the master, for every worker to arrive, to join, and for each collective."""
    latency_iterations: int = 20
    """Timed round trips per peer for the latency (after a few untimed ones)."""
    bandwidth_mib: int = 8
    """MiB sent each way per round trip for the bandwidth."""
    bandwidth_iterations: int = 5
    """Timed round trips per peer for the bandwidth."""

    def __post_init__(self) -> None:
        for name in ("nproc", "timeout", "latency_iterations", "bandwidth_mib", "bandwidth_iterations"):
            check_positive(name, getattr(self, name))
        if not 0 <= self.master_port <= 65535:
            raise ConfigError(f"master_port={self.master_port} is not a TCP port; use 1-65535, or 0 for a free one")


@dataclass(frozen=True)
class NetworkChoice:
    """The interface gloo binds its sockets to on this worker, and why."""

    interface: str
    """Interface name; empty when none was found (gloo then uses the host name's address)."""
    address: str
    """Address gloo binds to (the interface's, or the host name's)."""
    reason: str
    """Where the choice comes from: "GLOO_SOCKET_IFNAME", "route to the master" or "host name"."""

    @property
    def is_loopback(self) -> bool:
        """True when the address only reaches this host."""
        try:
            return ipaddress.ip_address(self.address).is_loopback
        except ValueError:
            return False


@dataclass(frozen=True)
class Devices:
    """What this worker can compute on."""

    cpu_count: int
    """CPUs of the machine."""
    usable_cpus: int
    """CPUs this process may run on (its affinity mask, e.g. Slurm's allocation)."""
    cuda: tuple[str, ...]
    """Names of the visible CUDA devices."""
    torch: str
    """torch.__version__."""
    gloo: bool
    """torch.distributed has the gloo backend."""
    nccl: bool
    """torch.distributed has the nccl backend."""


@dataclass(frozen=True)
class WorkerInfo:
    """One worker, as it reported itself at the roll call."""

    rank: int
    """Global rank."""
    node_rank: int
    """Index of its node."""
    local_rank: int
    """Rank on its node."""
    host: str
    """Host name."""
    interface: str
    """Interface gloo binds to ("" for the host name's address)."""
    address: str
    """Address gloo binds to."""
    stack: str
    """Identity of the network stack (boot id and network namespace): equal means loopback is shared."""
    pid: int
    """Process id, to find the worker on its host."""


@dataclass(frozen=True)
class Check:
    """One preflight step and how it went."""

    name: str
    """Which step: reach master, rendezvous store, roll call, join process group, all_reduce."""
    ok: bool
    """True when it passed."""
    detail: str
    """What was checked, or the diagnosis when it failed."""
    seconds: float = 0.0
    """How long it took."""


@dataclass(frozen=True)
class PeerLink:
    """Rank 0's measurements with one peer."""

    rank: int
    """The peer's global rank."""
    latency_us: float
    """Median half round trip of a 4-byte message, in microseconds."""
    latency_us_min: float
    """Fastest half round trip."""
    latency_us_max: float
    """Slowest half round trip."""
    bandwidth_gbps: float
    """Median bytes per second (in GB/s, 1e9) of one direction of a bandwidth_mib MiB round trip."""
    bandwidth_gbps_min: float
    """Lowest bandwidth of a round trip."""
    bandwidth_gbps_max: float
    """Highest bandwidth of a round trip."""


@dataclass
class Report:
    """Everything one worker found; rank 0's is the one printed."""

    environment: ClusterEnvironment
    """This worker's resolved environment."""
    host: str
    """This worker's host name."""
    network: NetworkChoice
    """The interface gloo binds to here."""
    backend: str
    """The process-group backend ddpkit.init uses."""
    devices: Devices
    """CPUs, CUDA devices, torch version."""
    checks: list[Check] = field(default_factory=list)
    """The steps run, in order; the last one failed if problem is set."""
    workers: list[WorkerInfo] = field(default_factory=list)
    """Every worker of the job, by rank (known to rank 0 after the roll call)."""
    peers: list[PeerLink] = field(default_factory=list)
    allreduce_latency_us: float | None = None
    """Median time of a 4-byte all_reduce over all workers."""
    warnings: list[str] = field(default_factory=list)
    """Things that look wrong but need not be (e.g. a loopback master for several nodes)."""
    problem: str = ""
    """The diagnosis of the check that failed; empty when all passed."""
    hints: list[str] = field(default_factory=list)
    """How to run the doctor across workers (shown to a process that runs alone)."""

    @property
    def ok(self) -> bool:
        """True when no check failed."""
        return not self.problem

    def to_dict(self) -> dict[str, Any]:
        """The report as plain JSON-serialisable data."""
        out = dataclasses.asdict(self)
        out["ok"] = self.ok
        return out


class DoctorProblem(Exception):
    """A check failed; the message is the diagnosis (what failed, where, what to check)."""

    def __init__(self, check: str, diagnosis: str, seconds: float = 0.0):
        super().__init__(diagnosis)
        self.check = check
        self.seconds = seconds


# -- what this worker is ------------------------------------------------------


def choose_network(environ: Mapping[str, str], master_addr: str) -> NetworkChoice:
    """The interface and address gloo will bind to, as ``ddpkit.init`` chooses it.

    Args:
        environ: The process environment; GLOO_SOCKET_IFNAME wins when set.
        master_addr: Address of rank 0.

    Returns:
        The choice; interface "" when no interface routes to master_addr
        (gloo then binds to the address the host name resolves to).
    """
    name = environ.get("GLOO_SOCKET_IFNAME", "")
    reason = "GLOO_SOCKET_IFNAME"
    if not name:
        name, reason = interface_for(master_addr) or "", "route to the master"
    if name:
        # The first address in GLOO_SOCKET_IFNAME if it lists several interfaces (gloo uses them all).
        first = name.split(",")[0]
        addresses = [ip for iface, ip in interface_addresses() if iface == first]
        # gloo prefers IPv4 when an interface has both.
        addresses.sort(key=lambda ip: ip.version)
        return NetworkChoice(name, str(addresses[0]) if addresses else "", reason)
    host = socket.gethostname()
    try:
        address = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][4][0]
    except OSError:
        address = ""
    return NetworkChoice("", address, "host name")


def resolved_backend(cfg: DoctorConfig, local_rank: int) -> str:
    """The backend ``ddpkit.init`` will use for cfg's backend and device.

    Raises:
        ValueError: unknown backend, or CUDA asked for where there is none.
    """
    import torch

    from ddpkit.distributed import resolve_backend, resolve_device

    return resolve_backend(cfg.backend, resolve_device(cfg.device, local_rank, torch.cuda.is_available()))


def describe_devices() -> Devices:
    """CPUs, CUDA devices, torch version and available backends of this process."""
    import torch
    import torch.distributed as dist

    cuda: tuple[str, ...] = ()
    if torch.cuda.is_available():
        cuda = tuple(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
    return Devices(
        cpu_count=os.cpu_count() or 0,
        usable_cpus=len(os.sched_getaffinity(0)),
        cuda=cuda,
        torch=torch.__version__,
        gloo=dist.is_gloo_available(),
        nccl=dist.is_nccl_available(),
    )


def network_stack_id() -> str:
    """An id equal for two processes exactly when they share a network stack (and so loopback)."""
    parts = []
    for path, read in (("/proc/sys/kernel/random/boot_id", _read_text), ("/proc/self/ns/net", os.readlink)):
        try:
            parts.append(read(path).strip())
        except OSError:
            parts.append(socket.gethostname())
    return "/".join(parts)


def run_hints() -> list[str]:
    """Commands that run the doctor as every worker of a job, for a process that runs alone."""
    return [
        "ddpkit doctor nproc=2                  # 2 workers on this machine",
        "torchrun --nnodes N --nproc-per-node K --rdzv-backend c10d --rdzv-endpoint HOST:PORT "
        "--local-addr THIS_HOST_ADDRESS -m ddpkit doctor   # on each node",
        "srun --nodes N --ntasks-per-node K python -m ddpkit doctor",
        "mpirun -np N python -m ddpkit doctor",
    ]


# -- 1. reach the master -----------------------------------------------------


def reach_master(env: ClusterEnvironment, timeout: float) -> Check:
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
            raise DoctorProblem("reach master", _unresolvable(env, e)) from None
        except OSError as e:
            error = e
        if time.monotonic() >= deadline:
            raise DoctorProblem("reach master", unreachable_diagnosis(env, error, timeout), timeout)
        time.sleep(0.2)


def unreachable_diagnosis(env: ClusterEnvironment, error: OSError, timeout: float) -> str:
    """What to check when rank ``env.rank`` cannot connect to the master's port."""
    where = f"{env.master_addr}:{env.master_port}"
    if isinstance(error, ConnectionRefusedError):
        why = "connection refused: nothing listens there"
        check = (
            f"check that rank 0 is running, that MASTER_PORT={env.master_port} is the same on every worker, "
            f"and that MASTER_ADDR={env.master_addr} is rank 0's host"
        )
    elif isinstance(error, TimeoutError) or error.errno == errno.ETIMEDOUT:
        why = "no answer (connection timed out)"
        check = (
            f"check that MASTER_ADDR={env.master_addr} is an address of rank 0's host that this host reaches "
            f"(`ip route get {env.master_addr}`, `ping {env.master_addr}`) and that no firewall drops "
            f"port {env.master_port}"
        )
    elif error.errno in (errno.ENETUNREACH, errno.EHOSTUNREACH):
        why = f"no route ({os.strerror(error.errno)})"
        check = (
            f"check this host's routes to {env.master_addr} (`ip route get {env.master_addr}`) "
            "and the network between the hosts"
        )
    else:
        why = str(error)
        check = f"check MASTER_ADDR={env.master_addr}, MASTER_PORT={env.master_port} and the network between the hosts"
    text = f"rank {env.rank}/{env.world_size} cannot reach the master at {where} within {timeout:g}s: {why}; {check}"
    if _is_loopback(env.master_addr) and env.num_nodes > 1:
        text += (
            f". MASTER_ADDR={env.master_addr} is a loopback address, but the job spans {env.num_nodes} nodes: "
            "set it to an address of rank 0's host that the other hosts reach. Under torchrun with "
            "--rdzv-backend c10d, pass --local-addr <this node's address> on every node: without it the "
            "rendezvous names the master by its host name, which may resolve to loopback"
        )
    return text


def _unresolvable(env: ClusterEnvironment, error: socket.gaierror) -> str:
    return (
        f"rank {env.rank}/{env.world_size} cannot resolve MASTER_ADDR={env.master_addr!r} ({error.strerror}); "
        "set MASTER_ADDR to an IP address or a host name that every node resolves (check /etc/hosts or DNS)"
    )


# -- 2. roll call -------------------------------------------------------------


def uses_agent_store(environ: Mapping[str, str]) -> bool:
    """True when torchrun's agent already runs the store at MASTER_ADDR:MASTER_PORT (torch's own test)."""
    return environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"


def open_store(env: ClusterEnvironment, environ: Mapping[str, str], timeout: float):
    """The rendezvous store at the master, started by rank 0 unless torchrun's agent runs it.

    Rank 0's server is multi-tenant, as torch's env:// rendezvous makes it:
    ``ddpkit.init`` on rank 0 then reuses this server (same port, same
    process) instead of binding the port again, so the store stays up from
    the roll call to the process group.

    Raises:
        DoctorProblem: rank 0 cannot listen on the port, or a worker cannot open the store.
    """
    import torch.distributed as dist

    host = not uses_agent_store(environ) and env.rank == 0
    try:
        store = dist.TCPStore(
            env.master_addr, env.master_port, None, host, timedelta(seconds=timeout),
            wait_for_workers=False, multi_tenant=True,
        )
    except (RuntimeError, dist.DistNetworkError, dist.DistStoreError) as e:
        text = str(e).splitlines()[0] if str(e) else type(e).__name__
        if host and ("address already in use" in text.lower() or "EADDRINUSE" in text):
            raise DoctorProblem(
                "rendezvous store",
                f"rank 0 cannot listen on port {env.master_port}: it is taken on this host ({text}); "
                "set MASTER_PORT to a free port (the same on every worker)",
            ) from None
        raise DoctorProblem(
            "rendezvous store", f"rank {env.rank}/{env.world_size} cannot open the store at "
            f"{env.master_addr}:{env.master_port}: {text}",
        ) from None
    prefix = _PREFIX
    if uses_agent_store(environ):
        # The agent's store outlives one run of the workers: keep restarts apart.
        prefix += f"{environ.get('TORCHELASTIC_RUN_ID', '')}/{environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
    return store, dist.PrefixStore(prefix, store)


def roll_call(store, me: WorkerInfo, env: ClusterEnvironment, timeout: float) -> tuple[list[WorkerInfo], Check]:
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
                "roll call", f"rank {env.rank}/{env.world_size} reached the store but rank 0 did not report the "
                f"roll call within {timeout + 10:g}s ({str(e).splitlines()[0]}); check rank 0's output",
            ) from None
        outcome = json.loads(store.get("roll"))
        store.set(f"read/{env.rank}", "1")
    workers = [WorkerInfo(**w) for w in outcome["workers"]]
    if outcome["problem"]:
        raise DoctorProblem("roll call", outcome["problem"], time.monotonic() - start)
    detail = f"{env.world_size} of {env.world_size} workers arrived, on {len({w.stack for w in workers})} host(s)"
    return workers, Check("roll call", True, detail, time.monotonic() - start)


def _wait_quietly(store, keys: Sequence[str], timeout: float) -> None:
    """Wait up to timeout for keys; a worker that vanished meanwhile is not a second problem."""
    import torch.distributed as dist

    if keys:
        try:
            store.wait(list(keys), timedelta(seconds=timeout))
        except (RuntimeError, dist.DistError):
            pass


def _collect(store, env: ClusterEnvironment, timeout: float) -> dict[str, Any]:
    keys = [f"arrived/{r}" for r in range(env.world_size)]
    deadline = time.monotonic() + timeout
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


def missing_diagnosis(
    env: ClusterEnvironment, missing: Sequence[int], present: Sequence[WorkerInfo], timeout: float
) -> str:
    """What to check when ranks did not arrive at the roll call."""
    hosts = sorted({f"{w.host} ({w.address})" for w in present})
    return (
        f"{_ranks(missing)} of {env.world_size} did not arrive at {env.master_addr}:{env.master_port} "
        f"within {timeout:g}s ({len(present)} arrived, from {', '.join(hosts)}); check that the missing workers were "
        "started with the same world size, master address and port, and look at their own output: a worker "
        "that cannot reach the master says so"
    )


def loopback_diagnosis(env: ClusterEnvironment, workers: Sequence[WorkerInfo]) -> str:
    """A problem when a worker would bind gloo to loopback while a peer is on another host; else ""."""
    for w in workers:
        if not _is_loopback(w.address):
            continue
        others = [o.rank for o in workers if o.stack != w.stack]
        if others:
            return (
                f"rank {w.rank} binds gloo to {w.address} ({w.interface or 'its host name'}), a loopback address, "
                f"but {_ranks(others)} on another host cannot connect to it; check the routes "
                f"between the hosts (`ip route get <peer address>`), or set GLOO_SOCKET_IFNAME to the interface "
                "whose address the other hosts reach (or unset it: ddpkit then picks the interface that routes "
                "to the master)"
            )
    return ""


# -- 3. to 5. the process group -------------------------------------------------


def join(cfg: DoctorConfig, env: ClusterEnvironment, environ: MutableMapping[str, str], workers: Sequence[WorkerInfo]):
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


def join_diagnosis(env: ClusterEnvironment, error: str, workers: Sequence[WorkerInfo]) -> str:
    """What to check when ``ddpkit.init`` failed after every worker reached the store."""
    first = error.splitlines()[0] if error else "unknown error"
    if "gloo" in error.lower() or "connectFullMesh" in error:
        addresses = ", ".join(f"rank {w.rank} {w.address} ({w.interface or 'host name'})" for w in workers)
        return (
            f"rank {env.rank}/{env.world_size}: gloo could not connect the workers to each other ({first}). "
            f"Each worker binds gloo to one address and every other worker must reach it: {addresses or 'unknown'}. "
            "Check the routes between the hosts (`ip route get <peer address>` on each) and that no firewall "
            "blocks ports between them, or set GLOO_SOCKET_IFNAME to the interface that reaches the other hosts"
        )
    return f"rank {env.rank}/{env.world_size} could not join the process group: {first}"


def sanity_all_reduce(ctx, timeout: float) -> Check:
    """all_reduce of each rank's number: the sum must be n(n-1)/2.

    Raises:
        DoctorProblem: wrong sum, or the collective failed (a worker left).
    """
    import torch
    import torch.distributed as dist

    n = ctx.world_size
    expected = n * (n - 1) // 2
    start = time.monotonic()
    value = torch.tensor([float(ctx.rank)], device=ctx.device)
    try:
        dist.all_reduce(value)
    except (RuntimeError, dist.DistError) as e:
        raise DoctorProblem(
            "all_reduce", f"rank {ctx.rank}/{n}: all_reduce failed within {timeout:g}s: "
            f"{str(e).splitlines()[0]}; a worker stopped or its network broke: check the other workers' output",
        ) from None
    got = value.item()
    if got != expected:
        raise DoctorProblem(
            "all_reduce", f"rank {ctx.rank}/{n}: all_reduce of the ranks gave {got:g}, expected {expected}"
        )
    return Check("all_reduce", True, f"sum of ranks {got:g} == {expected}", time.monotonic() - start)


def measure_peers(ctx, cfg: DoctorConfig) -> list[PeerLink]:
    """Rank 0's latency and bandwidth with each peer in turn (every rank calls it).

    Returns:
        On rank 0 one PeerLink per peer; [] on the others.
    """
    import torch

    small = torch.zeros(1, device=ctx.device)
    large = torch.zeros(cfg.bandwidth_mib * 2**20 // 4, device=ctx.device)
    links = []
    for peer in range(1, ctx.world_size):
        if ctx.rank == 0:
            sync = _sync(ctx)
            latency = [t / 2 * 1e6 for t in _round_trips(small, peer, cfg.latency_iterations, sync)]
            trips = _round_trips(large, peer, cfg.bandwidth_iterations, sync)
            bandwidth = [large.nbytes / (t / 2) / 1e9 for t in trips]
            links.append(PeerLink(
                peer, statistics.median(latency), min(latency), max(latency),
                statistics.median(bandwidth), min(bandwidth), max(bandwidth),
            ))
        elif ctx.rank == peer:
            _echo(small, cfg.latency_iterations)
            _echo(large, cfg.bandwidth_iterations)
    return links


def allreduce_latency(ctx, iterations: int) -> float:
    """Median seconds of a 4-byte all_reduce over every worker, in microseconds (rank 0's view)."""
    import torch
    import torch.distributed as dist

    value = torch.zeros(1, device=ctx.device)
    sync = _sync(ctx)
    times = []
    for i in range(_WARMUP_ROUND_TRIPS + iterations):
        start = time.perf_counter()
        dist.all_reduce(value)
        sync()
        if i >= _WARMUP_ROUND_TRIPS:
            times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def _round_trips(tensor, peer: int, iterations: int, sync) -> list[float]:
    import torch.distributed as dist

    times = []
    for i in range(_WARMUP_ROUND_TRIPS + iterations):
        start = time.perf_counter()
        dist.send(tensor, dst=peer)
        dist.recv(tensor, src=peer)
        sync()
        if i >= _WARMUP_ROUND_TRIPS:
            times.append(time.perf_counter() - start)
    return times


def _echo(tensor, iterations: int) -> None:
    import torch.distributed as dist

    for _ in range(_WARMUP_ROUND_TRIPS + iterations):
        dist.recv(tensor, src=0)
        dist.send(tensor, dst=0)


def _sync(ctx):
    import torch

    if ctx.device.type == "cuda":
        return torch.cuda.synchronize
    return lambda: None


# -- the whole run ------------------------------------------------------------


def examine(cfg: DoctorConfig, environ: MutableMapping[str, str]) -> Report:
    """Run every check as this worker and return its report; problems end up in the report, not raised.

    Args:
        cfg: The doctor's options.
        environ: The process environment (os.environ in a worker: torch's
            env:// rendezvous and gloo read the real one).

    Raises:
        ValueError: the launcher's variables are inconsistent (InconsistentEnvironment).
    """
    env = detect_environment(environ)
    network = choose_network(environ, env.master_addr)
    report = Report(env, socket.gethostname(), network, resolved_backend(cfg, env.local_rank), describe_devices())
    me = WorkerInfo(env.rank, env.node_rank, env.local_rank, report.host, network.interface, network.address,
                    network_stack_id(), os.getpid())
    if env.world_size == 1:
        report.workers = [me]
        if env.source == "local":
            report.hints = run_hints()
    if _is_loopback(env.master_addr) and env.num_nodes > 1:
        report.warnings.append(
            f"MASTER_ADDR={env.master_addr} is a loopback address but the job spans {env.num_nodes} nodes; "
            "workers on other hosts cannot reach it unless every node is this host"
        )
    try:
        _run_checks(cfg, env, environ, report, me)
    except DoctorProblem as p:
        report.checks.append(Check(p.check, False, str(p), p.seconds))
        report.problem = str(p)
    finally:
        from ddpkit import distributed

        distributed.shutdown()
    return report


def _run_checks(cfg: DoctorConfig, env: ClusterEnvironment, environ: MutableMapping[str, str], report: Report,
                me: WorkerInfo) -> None:
    store = None
    if env.world_size > 1:
        if env.rank == 0 and not uses_agent_store(environ):
            store, rolls = open_store(env, environ, cfg.timeout)  # rank 0 listens before it connects to itself
            report.checks.append(reach_master(env, cfg.timeout))
        else:
            report.checks.append(reach_master(env, cfg.timeout))
            store, rolls = open_store(env, environ, cfg.timeout)
        report.workers, check = roll_call(rolls, me, env, cfg.timeout)
        report.checks.append(check)
    ctx, check = join(cfg, env, environ, report.workers)
    report.checks.append(check)
    report.checks.append(sanity_all_reduce(ctx, cfg.timeout))
    if env.world_size > 1:
        report.peers = measure_peers(ctx, cfg)
        report.allreduce_latency_us = allreduce_latency(ctx, cfg.latency_iterations)
    del store  # after the process group: rank 0's server may be the group's store too


# -- output -------------------------------------------------------------------


def format_report(report: Report) -> str:
    """The report as text, for rank 0 to print."""
    env, net, dev = report.environment, report.network, report.devices
    cuda = f"{len(dev.cuda)} CUDA device(s): {', '.join(dev.cuda)}" if dev.cuda else "no CUDA device"
    backends = ", ".join(b for b, ok in (("gloo", dev.gloo), ("nccl", dev.nccl)) if ok) or "none"
    if net.interface:
        why = "set by GLOO_SOCKET_IFNAME" if net.reason == "GLOO_SOCKET_IFNAME" else "routes to the master"
        interface = f"{net.interface} {net.address} ({why})"
    else:
        interface = f"none routes to the master; gloo uses the host name's address {net.address or '(unresolved)'}"
    lines = [
        "ddpkit doctor",
        f"  environment   {env.source}: rank {env.rank} of world_size {env.world_size}, "
        f"local rank {env.local_rank} of {env.local_world_size}, node {env.node_rank} of {env.num_nodes}",
        f"  host          {report.host}",
        f"  master        {env.master_addr}:{env.master_port}",
        f"  interface     {interface}",
        f"  backend       {report.backend} (available: {backends})",
        f"  devices       {dev.cpu_count} CPUs ({dev.usable_cpus} usable), {cuda}, torch {dev.torch}",
    ]
    lines += [f"  warning       {w}" for w in report.warnings]
    lines.append("checks")
    for c in report.checks:
        timing = f" ({c.seconds:.2f} s)" if c.seconds >= 1 else f" ({c.seconds * 1e3:.1f} ms)"
        outcome = f"ok    {c.name}: {c.detail}" if c.ok else f"FAIL  {c.name}: see the problem below"
        lines.append(f"  {outcome}{timing}")
    if report.workers and report.ok and len(report.workers) > 1:
        lines.append("workers")
        lines += _table(report)
        if report.allreduce_latency_us is not None:
            workers, latency = len(report.workers), report.allreduce_latency_us
            lines.append(f"  all_reduce of 4 bytes over {workers} workers: {latency:.0f} us (median)")
    if report.hints:
        lines.append("This process runs alone: nothing to check between workers. To check a job, run the doctor "
                     "as every worker of it:")
        lines += [f"  {h}" for h in report.hints]
    lines.append(f"problem: {report.problem}" if report.problem else "result: OK")
    return "\n".join(lines)


def _table(report: Report) -> list[str]:
    links = {p.rank: p for p in report.peers}
    header = ("rank", "node", "host", "interface", "address", "latency us", "bandwidth GB/s")
    rows = [header]
    for w in report.workers:
        link = links.get(w.rank)
        if link:
            measured = (f"{link.latency_us:.0f}", f"{link.bandwidth_gbps:.2f}")
        else:
            measured = ("(rank 0)" if w.rank == 0 else "", "")
        rows.append((str(w.rank), str(w.node_rank), w.host, w.interface or "-", w.address or "-", *measured))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    return ["  " + "  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows]


def _print_report(report: Report, as_json: bool) -> None:
    if report.environment.rank == 0:
        print(json.dumps(report.to_dict(), indent=2) if as_json else format_report(report), flush=True)
    elif not report.ok:
        print(f"[rank {report.environment.rank}/{report.environment.world_size}] problem: {report.problem}",
              file=sys.stderr, flush=True)


def _local_worker(cfg: DoctorConfig) -> Report:
    """One of nproc local workers: the report goes back to the launching process."""
    return examine(cfg, os.environ)


def main(words: Sequence[str]) -> int:
    """``ddpkit doctor [key=value ...]``: run the checks as this worker (or as nproc local ones).

    Args:
        words: key=value options of DoctorConfig, or YAML files.

    Returns:
        0 when every check passed (on every local worker with nproc), 1 otherwise.

    Raises:
        ValueError: bad option or inconsistent launcher variables.
        LaunchError: a local worker crashed (not a failed check: those are reported).
    """
    cfg = parse(DoctorConfig, words)
    env = detect_environment(os.environ)
    if env.source != "local" or cfg.nproc == 1:
        report = examine(cfg, os.environ)
        _print_report(report, cfg.json)
        return 0 if report.ok else 1
    from ddpkit.launch.local import LaunchSpec, launch_local

    resolved_backend(cfg, 0)  # bad options fail here, once, rather than in every worker
    results = launch_local(LaunchSpec(cfg.nproc, cfg.master_port), _local_worker, cfg)
    reports = [results[rank] for rank in sorted(results)]
    for report in reports:
        _print_report(report, cfg.json)
    return 0 if all(r.ok for r in reports) else 1


def _is_loopback(address: str) -> bool:
    if address == "localhost":
        return True
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


def _ranks(ranks: Sequence[int]) -> str:
    """[3] -> "rank 3"; [0, 1, 2, 5] -> "ranks 0-2, 5"."""
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {_ranges(ranks)}"


def _ranges(ranks: Sequence[int]) -> str:
    """[0, 1, 2, 5] -> "0-2, 5"."""
    parts, start = [], None
    for i, r in enumerate(ranks):
        if start is None:
            start = r
        if i + 1 == len(ranks) or ranks[i + 1] != r + 1:
            parts.append(str(start) if start == r else f"{start}-{r}")
            start = None
    return ", ".join(parts)


def _read_text(path: str) -> str:
    with open(path) as f:
        return f.read()
