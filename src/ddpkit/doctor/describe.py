"""What this worker is: the interface gloo binds to, its devices, its backend, its network stack."""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping

from ddpkit.doctor.config import DoctorConfig
from ddpkit.doctor.results import Devices, NetworkChoice
from ddpkit.env.network import interface_addresses, interface_for


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
        address = str(
            socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][4][0]
        )  # IPv6 tuples: (host, port, flow, scope)
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


def _read_text(path: str) -> str:
    with open(path) as f:
        return f.read()
