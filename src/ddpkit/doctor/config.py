"""The options of ``ddpkit doctor``."""

from __future__ import annotations

from dataclasses import dataclass

from ddpkit.keyvalue import check_positive
from ddpkit.launchers.options import check_port


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
        check_port(self.master_port)
