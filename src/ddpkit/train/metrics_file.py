"""Machine-readable metric lines: ``metrics.jsonl``, one JSON object per event (rank 0 writes).

The lines a run writes (``time`` is seconds since the epoch, on every line)::

    {"event": "train", "epoch": 0, "global_step": 50, "loss": 1.41, "samples_per_s": 2050.6, "lr": 0.001}
    {"event": "checkpoint", "global_step": 938, "epoch": 0, "reason": "epoch_end", "path": "..."}
    {"event": "eval", "epoch": 1, "global_step": 938, "split": "test", "loss": 0.48, "accuracy": 0.83}
    {"event": "summary", "model": "mlp", ..., "world_size": 2, "test": {...}, "config": {...}}

``train`` lines come every ``log_every`` steps (rank 0's mean loss over those
steps, the throughput of all workers), ``eval`` lines at each epoch end with
the exact test metrics (``accuracy`` for classification, ``mse`` otherwise),
one ``summary`` line at the end. A resumed run appends to the same file, so a
step after the resumed checkpoint may appear twice; the later line is the one
that counts.

With ``logger=tensorboard`` the same numbers also go to TensorBoard event
files in ``<output_dir>/tensorboard`` (see :func:`tensorboard_scalars`).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from ddpkit.config import ConfigError

TENSORBOARD_MISSING = ("logger=tensorboard needs the tensorboard package, which is not installed; "
                       "pip install 'ddpkit[tensorboard]', or use logger=jsonl")


def check_logger(logger: str) -> None:
    """Raise ConfigError when ``logger`` needs a package that is not installed (called before any worker starts)."""
    if logger == "tensorboard":
        _summary_writer_class()


def _summary_writer_class() -> type:
    try:
        # torch.utils.tensorboard imports the tensorboard package (and checks its version) on import.
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise ConfigError(TENSORBOARD_MISSING) from None
    return SummaryWriter


def tensorboard_scalars(line: dict[str, Any]) -> dict[str, float]:
    """The TensorBoard scalars of one metrics line, by tag: ``train/loss``, ``test/accuracy``...

    Every number of a ``train`` line (tags ``train/...``) and of an ``eval``
    line (tags ``<split>/...``, e.g. ``test/loss``), except ``global_step``
    (the scalars' step) and ``time`` (their wall time). Other events have none.
    """
    if line["event"] == "train":
        prefix = "train"
    elif line["event"] == "eval":
        prefix = line.get("split", "eval")
    else:
        return {}
    return {f"{prefix}/{key}": value for key, value in line.items()
            if key not in ("event", "time", "global_step") and isinstance(value, (int, float))
            and not isinstance(value, bool)}


class MetricsWriter:
    """Appends JSON lines to ``metrics.jsonl`` (rank 0 only; other ranks write nothing).

    Args:
        output_dir: the run's folder.
        enabled: whether this process writes (rank 0).
        logger: ``jsonl``, or ``tensorboard`` to also write the same scalars as
            TensorBoard events in ``<output_dir>/tensorboard``.
        config: the run's config, written once as TensorBoard text (tensorboard only).

    Raises:
        ConfigError: ``logger=tensorboard`` without the tensorboard package.
    """

    def __init__(self, output_dir: str | Path, enabled: bool, logger: str = "jsonl",
                 config: dict[str, Any] | None = None):
        self.enabled = enabled
        self.path = Path(output_dir) / "metrics.jsonl"
        self._tensorboard = None
        if enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if logger == "tensorboard":
                self._tensorboard = _summary_writer_class()(log_dir=str(self.path.parent / "tensorboard"))
                if config is not None:
                    self._tensorboard.add_text("config", _as_text(config), global_step=0)
                    self._tensorboard.flush()
            self._file = open(self.path, "a", buffering=1)

    def write(self, event: str, **fields: Any) -> None:
        """Write one line ``{"event": event, "time": ..., **fields}`` (and its TensorBoard scalars)."""
        if not self.enabled:
            return
        line = {"event": event, "time": round(time.time(), 3), **fields}
        self._file.write(json.dumps(line) + "\n")
        if self._tensorboard is not None:
            self._to_tensorboard(line)

    def _to_tensorboard(self, line: dict[str, Any]) -> None:
        step = line.get("global_step", line.get("global_steps"))
        for tag, value in tensorboard_scalars(line).items():
            self._tensorboard.add_scalar(tag, value, global_step=step, walltime=line["time"])
        if line["event"] == "summary":
            self._tensorboard.add_text("summary", _as_text(line), global_step=step)
        # As the JSON lines are flushed line by line: a run stopped in any way
        # (preempted, killed) leaves both records up to the same point.
        self._tensorboard.flush()

    def close(self) -> None:
        """Close the file (and the TensorBoard writer)."""
        if self.enabled:
            self._file.close()
            if self._tensorboard is not None:
                self._tensorboard.close()


def _as_text(value: dict[str, Any]) -> str:
    # TensorBoard's text panel renders Markdown: indented lines show as code.
    return "\n".join("    " + line for line in json.dumps(value, indent=2).splitlines())
