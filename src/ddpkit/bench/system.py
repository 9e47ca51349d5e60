"""What a benchmark ran on, stored beside every result, and the statistics it reports."""

from __future__ import annotations

import datetime
import os
import platform
import statistics
import subprocess
from collections.abc import Sequence
from typing import Any

import torch


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (or the platform's best guess)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def machine_info() -> dict[str, Any]:
    """Torch version, CPU model, core count, host and date."""
    return {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpu_model": cpu_model(),
        "cores": len(os.sched_getaffinity(0)),
        "host": platform.node(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def summarize(samples: Sequence[float]) -> dict[str, float]:
    """Median, min, max and count of repeated measurements."""
    return {
        "median": statistics.median(samples),
        "min": min(samples),
        "max": max(samples),
        "n": len(samples),
    }


def machine_tag() -> str:
    """A short name for result files: cores and CPU family, e.g. ``2core-xeon``."""
    words = [w.lower() for w in cpu_model().replace("(R)", "").replace("(TM)", "").split() if w.isalpha()]
    family = next((w for w in words if w not in ("intel", "amd", "cpu", "processor", "core")), "cpu")
    return f"{len(os.sched_getaffinity(0))}core-{family}"


def check_run(out: subprocess.CompletedProcess[str], name: str) -> None:
    """Raise RuntimeError, with the end of its stderr, if the benchmark run ``name`` failed."""
    if out.returncode != 0:
        raise RuntimeError(f"benchmark run {name!r} failed (exit {out.returncode}):\n{out.stderr[-3000:]}")
