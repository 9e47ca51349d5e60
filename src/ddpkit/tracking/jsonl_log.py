"""JSON lines: ``<dir>/metrics.jsonl`` in the format ``ddpkit train`` writes, so ``ddpkit plot`` reads an own loop's run.

One line per event, each with ``event`` and ``time`` (seconds since the epoch)::

    {"event": "config", "time": ..., "config": {"lr": 0.1}}
    {"event": "train", "time": ..., "global_step": 6, "loss": 0.41}
    {"event": "eval", "time": ..., "global_step": 6, "split": "test", "accuracy": 0.93}
    {"event": "summary", "time": ..., "final_accuracy": 0.93}

A ``Tracker.log`` call becomes one line per split: a metric named
``<split>/<name>`` (``test/accuracy``, ``val/loss``) or ``test_<name>``,
``val_<name>`` (as Lightning names them) goes to an ``eval`` line of that
split, a plain name (``loss``), ``train/<name>`` or ``train_<name>`` to the
``train`` line, which ``ddpkit plot`` draws as the training loss. The hyperparameters go to a ``config`` line once, the summary to a
``summary`` line at the end. Every line is flushed as it is written and
synced to disk at each checkpoint; a resumed run first rewrites the file
without the lines at steps >= the first step it logs.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ddpkit.tracking.backend import Backend

FILE = "metrics.jsonl"
"""The file's name in its run folder."""


def format_line(event: str, fields: Mapping[str, Any], wall_time: float | None = None) -> str:
    """One line of metrics.jsonl, newline included: ``{"event": event, "time": ..., **fields}``."""
    stamp = time.time() if wall_time is None else wall_time
    return json.dumps({"event": event, "time": round(stamp, 3), **fields}) + "\n"


SPLITS = ("train", "val", "test")
"""The splits a metric's name may start with as ``<split>_<name>``."""


def split_name(name: str) -> tuple[str, str]:
    """(split, metric) of a logged name: ``test/accuracy`` and ``test_accuracy`` -> (test, accuracy); loss -> (train, loss)."""
    split, _, metric = name.rpartition("/")
    if split:
        return split, metric
    head, _, tail = name.partition("_")
    return (head, tail) if head in SPLITS and tail else ("train", name)


class JsonlLog(Backend):
    """Writes ``metrics.jsonl`` (see the module docstring)."""

    def open(self, run_id: str | None, config: Mapping[str, Any] | None, drop_from: int | None) -> str:
        """Start ``metrics.jsonl`` (refused where one exists: runs would mix) or continue it."""
        self.path = self.dir / FILE
        self.dir.mkdir(parents=True, exist_ok=True)
        if run_id is None and self.path.exists():
            raise FileExistsError(f"{self.path} exists; a new run would mix with it: track into another folder")
        if drop_from is not None and self.path.exists():
            _rewrite(self.path, [row for row in _rows(self.path) if _before(row, drop_from)])
        self.file = open(self.path, "a", buffering=1)
        if run_id is None and config:
            self.file.write(format_line("config", {"config": dict(config)}))
        return str(self.path)

    def log(self, metrics: dict[str, float], step: int, wall_time: float) -> None:
        """Append a ``train`` line and an ``eval`` line per split, each with the metrics it has."""
        splits: dict[str, dict[str, float]] = {}
        for name, value in metrics.items():
            split, metric = split_name(name)
            splits.setdefault(split, {})[metric] = value
        for split, values in splits.items():
            if split == "train":
                self.file.write(format_line("train", {"global_step": step, **values}, wall_time))
            else:
                self.file.write(format_line("eval", {"global_step": step, "split": split, **values}, wall_time))

    def flush(self) -> None:
        """Sync the file to disk."""
        self.file.flush()
        os.fsync(self.file.fileno())

    def close(self, summary: Mapping[str, Any] | None) -> None:
        """Write the ``summary`` line (when given) and close the file."""
        if summary:
            self.file.write(format_line("summary", dict(summary)))
        self.file.close()


def _rows(path: Path) -> list[str]:
    # A run killed while writing leaves its last line without a newline: it is dropped with the steps after it.
    return [row for row in path.read_text().splitlines(keepends=True) if row.endswith("\n")]


def _before(row: str, step: int) -> bool:
    """True for a row without a global step, or with one before ``step``."""
    row_step = _step(row)
    return row_step is None or row_step < step


def _step(row: str) -> int | None:
    try:
        step = json.loads(row).get("global_step")
    except json.JSONDecodeError:
        return None
    return step if isinstance(step, int) else None


def _rewrite(path: Path, rows: list[str]) -> None:
    """Write the whole file through a temporary file and an atomic rename (a crash leaves the old or the new)."""
    temporary = path.with_name(path.name + ".tmp")
    with open(temporary, "w") as f:
        f.writelines(rows)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temporary, path)
