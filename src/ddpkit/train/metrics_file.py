"""Machine-readable metric lines: ``metrics.jsonl``, one JSON object per event (rank 0 writes)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any


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
