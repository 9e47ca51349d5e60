"""What the doctor finds: the typed values its steps produce, and the failure of one step."""

from __future__ import annotations

import dataclasses
import ipaddress
from dataclasses import dataclass, field
from typing import Any

from ddpkit.env.base import JobEnvironment


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

    environment: JobEnvironment
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
