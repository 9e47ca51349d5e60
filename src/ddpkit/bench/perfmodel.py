"""The alpha-beta model of data-parallel step time, and its projection to other networks.

A data-parallel step on ``p`` workers costs the compute of one worker's share
of the batch plus the gradient all_reduce that backward does not hide::

    step(p) = compute(batch per worker) + allreduce(gradient bytes)
    allreduce(n) = alpha + n * beta                 (fitted on this machine)
    compute(b)   = c0 + c1 * b                      (fitted from b = B and B/2)

``alpha`` (seconds) is the latency of one all_reduce call, ``beta`` (seconds
per byte) the inverse of its throughput; both are fitted by least squares to
all_reduce times measured at a few sizes with the algorithm in use. No DDP
overlap is assumed (the whole all_reduce counts), which makes the model an
upper bound where backward hides part of the communication.

Projection to a network with link latency ``alpha`` and bandwidth ``bw``
uses the ring all_reduce's cost (Patarasuk and Yuan), the optimum in bytes
sent per rank::

    ring(p, n) = 2 (p - 1) alpha + 2 (p - 1) / p * n / bw

Speedup is samples per second at ``p`` workers over samples per second at
one, so it covers both a fixed global batch (strong scaling: the per-worker
batch shrinks as ``B / p``) and a fixed per-worker batch (weak scaling).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class LinearFit:
    """``y = intercept + slope * x``, fitted by least squares."""

    intercept: float
    """Value at x = 0 (alpha: seconds per call; c0: seconds per step)."""
    slope: float
    """Increase per unit of x (beta: seconds per byte; c1: seconds per sample)."""

    def __call__(self, x: float) -> float:
        """The fitted value at ``x``."""
        return self.intercept + self.slope * x


def fit_line(xs: Sequence[float], ys: Sequence[float]) -> LinearFit:
    """Least-squares fit of ``y = a + b x``, with ``a`` and ``b`` clamped at 0 (times cannot be negative).

    Args:
        xs: abscissae (bytes, samples); at least one.
        ys: measured times, same length as ``xs``.

    Returns:
        The fit. With one point, or all ``xs`` equal, the line is flat at their mean.

    Raises:
        ValueError: empty or mismatched inputs.
    """
    if not xs or len(xs) != len(ys):
        raise ValueError(f"fit_line needs equal, non-empty xs and ys; got {len(xs)} and {len(ys)} values")
    n = len(xs)
    mean_x, mean_y = sum(xs) / n, sum(ys) / n
    var_x = sum((x - mean_x) ** 2 for x in xs)
    if var_x == 0:
        return LinearFit(mean_y, 0.0)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / var_x
    if slope < 0:  # noise on a flat curve: call it flat
        return LinearFit(mean_y, 0.0)
    intercept = mean_y - slope * mean_x
    if intercept < 0:  # a line through the origin fits better than a negative latency
        return LinearFit(0.0, sum(x * y for x, y in zip(xs, ys)) / sum(x * x for x in xs))
    return LinearFit(intercept, slope)


@dataclass(frozen=True)
class Network:
    """A link between nodes, for the projection."""

    name: str
    """How the report names it."""
    latency_s: float
    """One message's latency (alpha), seconds."""
    bandwidth_bytes_per_s: float
    """Link bandwidth, bytes per second."""


NETWORKS = (
    # Typical measured figures, not peak marketing ones: TCP over 25 GbE pays a
    # kernel round trip per message; InfiniBand HDR verbs about 2 us.
    Network("25 Gb/s Ethernet (TCP)", 20e-6, 25e9 / 8),
    Network("200 Gb/s InfiniBand", 2e-6, 200e9 / 8),
)
"""The networks the report projects onto by default."""


def ring_allreduce_seconds(world_size: int, num_bytes: float, network: Network) -> float:
    """Ring all_reduce time: ``2(p-1) alpha + 2(p-1)/p * n / bw``; 0 for one worker.

    Args:
        world_size: workers ``p`` (one per node).
        num_bytes: bytes reduced (the gradients).
        network: the link.
    """
    if world_size <= 1:
        return 0.0
    p = world_size
    return 2 * (p - 1) * network.latency_s + 2 * (p - 1) / p * num_bytes / network.bandwidth_bytes_per_s


@dataclass(frozen=True)
class Workload:
    """What the model needs to know about a training step."""

    batch_size: int
    """Global batch (batch_scope=global) or per-worker batch (per_worker)."""
    per_worker: bool
    """True when every worker takes ``batch_size`` samples (weak scaling)."""
    gradient_bytes: int
    """Bytes of gradients all-reduced per step."""
    compute: LinearFit
    """Compute seconds of one step as a function of the per-worker batch (data, forward, backward, optimizer)."""

    def batch_per_worker(self, world_size: int) -> float:
        """Samples per worker per step (fractional when the global batch does not divide)."""
        return self.batch_size if self.per_worker else self.batch_size / world_size

    def global_batch(self, world_size: int) -> int:
        """Samples per step over all workers."""
        return self.batch_size * world_size if self.per_worker else self.batch_size

    def max_workers(self) -> int:
        """Most workers that each get at least one sample."""
        return 10**9 if self.per_worker else self.batch_size


def predicted_step_seconds(workload: Workload, world_size: int, comm_seconds: float) -> float:
    """Step time on ``world_size`` workers: compute of one worker's share + all_reduce time."""
    return workload.compute(workload.batch_per_worker(world_size)) + comm_seconds


@dataclass(frozen=True)
class ProjectionPoint:
    """The projected figures of one worker count on one network."""

    world_size: int
    step_s: float
    compute_s: float
    comm_s: float
    speedup: float
    efficiency: float


def project(workload: Workload, network: Network, world_sizes: Sequence[int]) -> list[ProjectionPoint]:
    """Projected step time, speedup and efficiency at each worker count (one worker per node).

    Worker counts above :meth:`Workload.max_workers` (workers without a sample) are left out.
    """
    one = predicted_step_seconds(workload, 1, 0.0)
    rate_one = workload.global_batch(1) / one
    points = []
    for p in world_sizes:
        if p > workload.max_workers():
            continue
        comm = ring_allreduce_seconds(p, workload.gradient_bytes, network)
        step = predicted_step_seconds(workload, p, comm)
        speedup = (workload.global_batch(p) / step) / rate_one
        points.append(ProjectionPoint(p, step, step - comm, comm, speedup, speedup / p))
    return points


@dataclass(frozen=True)
class ScalingLimit:
    """Where scaling stops on one network."""

    best_world_size: int
    """Worker count of the highest speedup."""
    best_speedup: float
    half_efficiency_world_size: int | None
    """First worker count whose efficiency falls below 50% (None: never, within the range)."""


def scaling_limit(points: Sequence[ProjectionPoint]) -> ScalingLimit:
    """The best speedup and where efficiency first drops under 50%.

    Raises:
        ValueError: no points.
    """
    if not points:
        raise ValueError("scaling_limit needs at least one projected point; widen the worker range")
    best = max(points, key=lambda q: q.speedup)
    half = next((q.world_size for q in points if q.efficiency < 0.5), None)
    return ScalingLimit(best.world_size, best.speedup, half)


def projection_world_sizes(max_world_size: int = 1000) -> list[int]:
    """1, 2, 4, ... and a few points in between (about 6 per decade), up to ``max_world_size``."""
    sizes = {1, max_world_size}
    steps = 6 * math.log10(max(max_world_size, 2))
    for i in range(int(steps) + 1):
        sizes.add(max(1, round(10 ** (i / 6))))
    sizes.update(2**k for k in range(int(math.log2(max_world_size)) + 1))
    return sorted(s for s in sizes if s <= max_world_size)
