"""Machine-readable metric lines: ``metrics.jsonl``, one JSON object per event (rank 0 writes).

The lines a run writes (``time`` is seconds since the epoch, on every line)::

    {"event": "train", "epoch": 0, "global_step": 50, "loss": 1.41, "samples_per_s": 2050.6, "lr": 0.001}
    {"event": "checkpoint", "global_step": 938, "epoch": 0, "reason": "epoch_end", "path": "..."}
    {"event": "eval", "epoch": 1, "global_step": 938, "split": "test", "loss": 0.48, "accuracy": 0.83}
    {"event": "summary", "model": "mlp", ..., "world_size": 2, "test": {...}, "config": {...}}

``train`` lines come every ``log_every`` steps and for the steps left at an
epoch's end or at ``max_steps`` (rank 0's mean loss over the steps the line
covers, the throughput of all workers), ``eval`` lines at each epoch end with
the exact test metrics (``accuracy`` for classification, ``mse`` otherwise)
and at ``max_steps`` (its ``epoch`` a fraction: epochs trained), one
``summary`` line at the end. The format is :mod:`ddpkit.tracking.jsonl_log`'s,
which ``Tracker("jsonl")`` writes from an own loop. A resumed run appends to the same file, so a
step after the resumed checkpoint may appear twice; the later line is the one
that counts.

With ``logger=csv|tensorboard|mlflow|wandb`` the same numbers also go to a
:class:`ddpkit.Tracker` (see :func:`tracked_scalars`), which continues its
tracked run on resume without repeating a step.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

from ddpkit.checkpoint import format_bytes, free_bytes
from ddpkit.errors import UserError
from ddpkit.names import EXIT_STORAGE
from ddpkit.tracking.backends import BACKENDS, install_hint
from ddpkit.tracking.jsonl_log import FILE, format_line


def check_logger(logger: str) -> None:
    """Raise UserError when ``logger`` needs a package that is not installed (called before any worker starts)."""
    hint = install_hint(logger) if logger in BACKENDS else None
    if hint is not None:
        raise UserError(f"logger={logger} needs {hint}, or use logger=jsonl")


def tracked_scalars(line: dict[str, Any]) -> dict[str, float]:
    """The tracked metrics of one metrics line, by name: ``train/loss``, ``test/accuracy``...

    Every number of a ``train`` line (tags ``train/...``) and of an ``eval``
    line (tags ``<split>/...``, e.g. ``test/loss``), except ``global_step``
    (their step) and ``time``. Other events have none.
    """
    if line["event"] == "train":
        prefix = "train"
    elif line["event"] == "eval":
        prefix = line.get("split", "eval")
    else:
        return {}
    return {
        f"{prefix}/{key}": value
        for key, value in line.items()
        if key not in ("event", "time", "global_step")
        and isinstance(value, (int, float))
        and not isinstance(value, bool)
    }


class MetricsWriteError(UserError):
    """metrics.jsonl (or summary.json) could not be written: a full disk, a quota, a folder gone read-only."""

    exit_status = EXIT_STORAGE
    """The exit status of the worker and of ``ddpkit train``, as for a checkpoint that cannot be written."""


def write_error(path: Path, error: OSError) -> MetricsWriteError:
    """The one line for ``error`` writing ``path``: the reason, the room there, and the fix."""
    return MetricsWriteError(
        f"cannot write {path}: {error.strerror or error} ({format_bytes(free_bytes(path.parent))} free there); free "
        "space there or choose another folder (output_dir=...), then continue with resume=auto"
    )


class MetricsWriter:
    """Appends JSON lines to ``metrics.jsonl`` (rank 0 only; other ranks write nothing).

    Args:
        output_dir: the run's folder.
        enabled: whether this process writes (rank 0).
        tracker: a :class:`ddpkit.Tracker` that also gets each line's scalars (:func:`tracked_scalars`)
            at its global step; None for metrics.jsonl only.
    """

    def __init__(self, output_dir: str | Path, enabled: bool, tracker: Any = None):
        self.enabled = enabled
        self.path = Path(output_dir) / FILE
        self.tracker = tracker if enabled else None
        if enabled:
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self._file = open(self.path, "a", buffering=1)
            except OSError as e:
                raise write_error(self.path, e) from None

    def write(self, event: str, **fields: Any) -> None:
        """Write one line ``{"event": event, "time": ..., **fields}`` (and give the tracker its scalars)."""
        if not self.enabled:
            return
        try:
            self._file.write(format_line(event, fields))
        except OSError as e:
            self._drop()
            raise write_error(self.path, e) from None
        scalars = tracked_scalars({"event": event, **fields})
        if self.tracker is not None and scalars:
            self.tracker.log(scalars, step=fields["global_step"])

    def close(self) -> None:
        """Close the file."""
        if self.enabled:
            self.enabled = False
            try:
                self._file.close()
            except OSError as e:
                raise write_error(self.path, e) from None

    def _drop(self) -> None:
        """After a failed write: close the file, dropping what the full disk would not take; write no more."""
        self.enabled = False
        with contextlib.suppress(OSError):
            self._file.close()  # the unwritten buffer is flushed once more, and fails again
