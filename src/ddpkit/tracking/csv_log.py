"""CSV: ``<dir>/metrics.csv``, one row per ``log`` call, as Lightning's CSVLogger writes it.

Columns: ``step``, then one per metric in the order they first appear (a
row leaves the metrics it does not have empty). A metric seen for the first
time rewrites the file with the wider header. The hyperparameters go to
``<dir>/hparams.yaml`` once; a summary is not kept (``metrics.csv`` holds
series). Every row is flushed as it is written, and synced to disk at each
checkpoint; a resumed run first rewrites the file without the rows at
steps >= the first step it logs.
"""

from __future__ import annotations

import csv
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ddpkit.tracking.backend import Backend

FILE = "metrics.csv"
HPARAMS = "hparams.yaml"


class CsvLog(Backend):
    """Writes ``metrics.csv`` (see the module docstring)."""

    def open(self, run_id: str | None, config: Mapping[str, Any] | None, drop_from: int | None) -> str:
        """Start ``metrics.csv`` (refused where one exists: runs would mix) or continue it."""
        self.path = self.dir / FILE
        self.dir.mkdir(parents=True, exist_ok=True)
        if run_id is None and self.path.exists():
            raise FileExistsError(f"{self.path} exists; a new run would mix with it: track into another folder")
        self.columns, rows = _read(self.path) if self.path.exists() else (["step"], [])
        if drop_from is not None:
            rows = [row for row in rows if int(row["step"]) < drop_from]
        _rewrite(self.path, self.columns, rows)
        if run_id is None and config:
            import yaml

            (self.dir / HPARAMS).write_text(yaml.safe_dump(dict(config), sort_keys=False))
        self.file = open(self.path, "a", newline="", buffering=1)
        return str(self.path)

    def log(self, metrics: dict[str, float], step: int, wall_time: float) -> None:
        """Append one row (first widening the header for metrics not seen before)."""
        new = [key for key in metrics if key not in self.columns]
        if new:
            self.file.close()
            self.columns, rows = _read(self.path)
            self.columns += new
            _rewrite(self.path, self.columns, rows)
            self.file = open(self.path, "a", newline="", buffering=1)
        csv.DictWriter(self.file, self.columns).writerow({"step": step, **metrics})
        self.file.flush()

    def flush(self) -> None:
        """Sync the file to disk."""
        self.file.flush()
        os.fsync(self.file.fileno())

    def close(self, summary: Mapping[str, Any] | None) -> None:
        """Close the file."""
        self.file.close()


def _read(path: Path) -> tuple[list[str], list[dict[str, str]]]:
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        rows = list(reader)
        return list(reader.fieldnames or ["step"]), rows


def _rewrite(path: Path, columns: list[str], rows: list[dict[str, str]]) -> None:
    """Write the whole file through a temporary file and an atomic rename (a crash leaves the old or the new)."""
    temporary = path.with_name(path.name + ".tmp")
    with open(temporary, "w", newline="") as f:
        writer = csv.DictWriter(f, columns)
        writer.writeheader()
        writer.writerows(rows)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temporary, path)
