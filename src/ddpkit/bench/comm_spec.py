"""What ``ddpkit bench comm`` runs and against what: its options, its names and its targets.

Read by the benchmark (:mod:`ddpkit.bench.comm`) and by its report
(:mod:`ddpkit.bench.comm_report`), which import this module and not each
other.
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypedDict

from ddpkit.keyvalue import ConfigError, check_positive

PINGPONG = "pingpong"
"""The point-to-point op: rank 0 with every other rank in turn."""

BENCHMARKED_COLLECTIVES = (
    "all_reduce",
    "reduce",
    "broadcast",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "all_to_all",
    "all_to_all_single",
    "gather",
    "scatter",
)
"""Collectives of :data:`ddpkit.comm.COLLECTIVES` this benchmark can run (all but barrier, which moves no data)."""

DEFAULT_OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce", "all_to_all", PINGPONG)

BUILTIN = "builtin"
DTYPES = ("float32", "float64", "float16", "bfloat16", "int32", "int64")
MIB = 1 << 20


class SpeedupTarget(TypedDict):
    """T3: an algorithm at least ``min_speedup`` times faster than the built-in, over a range of sizes."""

    algorithm: str
    min_speedup: float
    min_bytes: int
    max_bytes: int
    world_size: int


class RatioTarget(TypedDict):
    """T4: an algorithm at most ``max_ratio`` times the built-in's time, from ``min_bytes`` on."""

    algorithm: str
    max_ratio: float
    min_bytes: int


TARGET_T3: SpeedupTarget = {
    "algorithm": "shm",
    "min_speedup": 5.0,
    "min_bytes": 4,
    "max_bytes": 32 * MIB,
    "world_size": 2,
}
TARGET_T4: RatioTarget = {"algorithm": "ring", "max_ratio": 1.5, "min_bytes": 1 * MIB}
"""T3 and T4 (see :mod:`ddpkit.bench.comm`): compared as ratios of median times from the same run."""

DEVICES = ("cpu", "cuda")
"""Where the measured messages can live (``device=``)."""


@dataclasses.dataclass
class CommBenchConfig:
    """Options of ``ddpkit bench comm``."""

    nproc: int = 2
    """Local workers to start when not already running under torchrun, srun or mpirun."""
    ops: list[str] = dataclasses.field(default_factory=lambda: list(DEFAULT_OPS))
    """Ops to measure, in order: collectives by their torch.distributed name, and pingpong."""
    algorithms: list[str] = dataclasses.field(default_factory=list)
    """Algorithms to run where an op has them (e.g. [builtin,ring,shm]); empty: every one available here."""
    min_bytes: int = 4
    """Smallest message, in bytes."""
    max_bytes: int = 64 * MIB
    """Largest message, in bytes."""
    step_factor: int = 2
    """Each size is this many times the previous one (2 or more)."""
    warmup: int = 3
    """Untimed calls before each measurement (they also estimate one call's time)."""
    iterations: int = 0
    """Calls per timed batch; 0 picks it per size so that the batches take about target_seconds."""
    repeats: int = 5
    """Timed batches per size and algorithm: the samples of the median, min and max."""
    target_seconds: float = 0.2
    """Timed seconds per size and algorithm when iterations=0 (at least one call per batch)."""
    dtype: str = "float32"
    """Element type of the messages."""
    device: str = "cpu"
    """Where the messages live: cpu (gloo) or cuda (each worker's GPU, nccl)."""
    smoke: bool = False
    """A tiny run (4 B..64 KiB, x4 steps, 2 batches of 2 calls) to check that the benchmark works."""
    output_dir: str = "benchmarks"
    """Folder for the JSON, Markdown and PNG results."""
    tag: str = ""
    """Suffix of the result files' names (e.g. preliminary), after the date."""
    timeout: float = 300.0
    """Seconds a rank waits for its peers (to join, or in any call) before failing."""

    def __post_init__(self) -> None:
        check_positive("nproc", self.nproc)
        check_positive("min_bytes", self.min_bytes)
        check_positive("warmup", self.warmup)
        check_positive("iterations", self.iterations, allow_zero=True)
        check_positive("repeats", self.repeats)
        check_positive("target_seconds", self.target_seconds)
        check_positive("timeout", self.timeout)
        if self.max_bytes < self.min_bytes:
            raise ConfigError(f"max_bytes={self.max_bytes} is below min_bytes={self.min_bytes}; raise max_bytes")
        if self.step_factor < 2:
            raise ConfigError(f"step_factor={self.step_factor} is not valid; it must be 2 or more")
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype={self.dtype!r} is not valid; choose one of: {', '.join(DTYPES)}")
        if self.device not in DEVICES:
            raise ConfigError(f"device={self.device!r} is not valid; choose one of: {', '.join(DEVICES)}")
        if not self.ops:
            raise ConfigError(f"ops is empty; name at least one of: {', '.join((*BENCHMARKED_COLLECTIVES, PINGPONG))}")
        for op in self.ops:
            if op not in (*BENCHMARKED_COLLECTIVES, PINGPONG):
                raise ConfigError(
                    f"ops: {op!r} is not an op this benchmark runs; choose among: "
                    f"{', '.join((*BENCHMARKED_COLLECTIVES, PINGPONG))}"
                )
        if len(set(self.ops)) != len(self.ops):
            raise ConfigError(f"ops={self.ops} names an op twice; name each once")
        if "/" in self.tag or self.tag.startswith("."):
            raise ConfigError(f"tag={self.tag!r} is not valid in a file name; use letters, digits and '-'")


def median_times(collectives: list[dict[str, Any]], op: str, algorithm: str) -> dict[int, float]:
    """``{bytes: median time in us}`` of the rows of ``op`` run with ``algorithm``."""
    return {r["bytes"]: r["time_us"]["median"] for r in collectives if r["op"] == op and r["algorithm"] == algorithm}
