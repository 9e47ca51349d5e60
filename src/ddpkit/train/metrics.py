"""Exact metrics across ranks, and machine-readable metric lines.

Metrics are computed as sums and counts on each rank's shard and added up with
one all_reduce, so the result is the same as on one process, whatever the
number of workers (no averaging of averages, no padded duplicates).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist


def reduce_sums(values: dict[str, float | torch.Tensor]) -> dict[str, float]:
    """Add ``values`` up across all ranks (float64, one all_reduce)."""
    names = list(values)
    packed = torch.tensor([float(values[n]) for n in names], dtype=torch.float64)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(packed)
    return dict(zip(names, packed.tolist()))


class MetricsWriter:
    """Appends JSON lines to ``metrics.jsonl`` (rank 0 only; other ranks write nothing)."""

    def __init__(self, output_dir: str | Path, enabled: bool):
        self.enabled = enabled
        self.path = Path(output_dir) / "metrics.jsonl"
        if enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "a", buffering=1)

    def write(self, event: str, **fields: Any) -> None:
        """Write one line ``{"event": event, "time": ..., **fields}``."""
        if self.enabled:
            self._file.write(json.dumps({"event": event, "time": round(time.time(), 3), **fields}) + "\n")

    def close(self) -> None:
        """Close the file."""
        if self.enabled:
            self._file.close()
