"""Step 5 of the doctor: rank 0's latency and bandwidth with each peer, and the all_reduce latency."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from ddpkit.doctor.checks import probe_device
from ddpkit.doctor.config import DoctorConfig
from ddpkit.doctor.results import PeerLink

if TYPE_CHECKING:
    import torch

    from ddpkit.distributed import Context

_WARMUP_ROUND_TRIPS = 3


def measure_peers(ctx: Context, cfg: DoctorConfig) -> list[PeerLink]:
    """Rank 0's latency and bandwidth with each peer in turn (every rank calls it).

    Returns:
        On rank 0 one PeerLink per peer; [] on the others.
    """
    import torch

    device = probe_device(ctx)
    small = torch.zeros(1, device=device)
    large = torch.zeros(cfg.bandwidth_mib * 2**20 // 4, device=device)
    links: list[PeerLink] = []
    for peer in range(1, ctx.world_size):
        if ctx.rank == 0:
            sync = _sync(ctx)
            latency = [t / 2 * 1e6 for t in _round_trips(small, peer, cfg.latency_iterations, sync)]
            trips = _round_trips(large, peer, cfg.bandwidth_iterations, sync)
            bandwidth = [large.nbytes / (t / 2) / 1e9 for t in trips]
            links.append(
                PeerLink(
                    peer,
                    statistics.median(latency),
                    min(latency),
                    max(latency),
                    statistics.median(bandwidth),
                    min(bandwidth),
                    max(bandwidth),
                )
            )
        elif ctx.rank == peer:
            _echo(small, cfg.latency_iterations)
            _echo(large, cfg.bandwidth_iterations)
    return links


def allreduce_latency(ctx: Context, iterations: int) -> float:
    """Median seconds of a 4-byte all_reduce over every worker, in microseconds (rank 0's view)."""
    import torch
    import torch.distributed as dist

    value = torch.zeros(1, device=probe_device(ctx))
    sync = _sync(ctx)
    times: list[float] = []
    for i in range(_WARMUP_ROUND_TRIPS + iterations):
        start = time.perf_counter()
        dist.all_reduce(value)
        sync()
        if i >= _WARMUP_ROUND_TRIPS:
            times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def _round_trips(tensor: torch.Tensor, peer: int, iterations: int, sync: Callable[[], None]) -> list[float]:
    import torch.distributed as dist

    times: list[float] = []
    for i in range(_WARMUP_ROUND_TRIPS + iterations):
        start = time.perf_counter()
        dist.send(tensor, dst=peer)
        dist.recv(tensor, src=peer)
        sync()
        if i >= _WARMUP_ROUND_TRIPS:
            times.append(time.perf_counter() - start)
    return times


def _echo(tensor: torch.Tensor, iterations: int) -> None:
    import torch.distributed as dist

    for _ in range(_WARMUP_ROUND_TRIPS + iterations):
        dist.recv(tensor, src=0)
        dist.send(tensor, dst=0)


def _sync(ctx: Context) -> Callable[[], None]:
    import torch

    if probe_device(ctx).type == "cuda":
        return torch.cuda.synchronize
    return lambda: None
