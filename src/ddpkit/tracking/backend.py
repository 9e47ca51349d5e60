"""The small interface every tracking backend implements; rank 0's :class:`ddpkit.Tracker` drives it.

A backend writes one tracked run. The Tracker calls, on rank 0 only:

- ``open(run_id, config, drop_from)`` before the first value: create a run
  (``run_id`` None; ``config`` is recorded as its hyperparameters) or continue
  the run ``run_id`` (a resumed checkpoint's), first removing every value it
  holds at steps ``>= drop_from`` (what a stopped run logged after that
  checkpoint; None: nothing to remove). Returns the run's identity.
- ``log(metrics, step, wall_time)`` for each call of ``Tracker.log`` (``wall_time``: when it was
  called, seconds since the epoch);
- ``flush()`` at each checkpoint: every value logged so far is durable;
- ``close(summary)`` at the end of a run.
"""

from __future__ import annotations

import abc
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ddpkit.errors import UserError


class Backend(abc.ABC):
    """One tracking backend (CSV, TensorBoard, MLflow, W&B); see the module docstring.

    Args:
        dir: the folder it writes into (created when a run opens).
        project: the project (MLflow experiment, W&B project) the run belongs to.
        run_name: a human-readable name of the run ("" lets the backend choose).
        options: the backend's own options (``Tracker(kind, ..., **options)``).

    Raises:
        UserError: an option the backend does not take.
    """

    OPTIONS: tuple[str, ...] = ()
    """The names of the backend's own options."""

    def __init__(self, dir: Path, project: str, run_name: str, options: Mapping[str, Any]):
        unknown = sorted(set(options) - set(self.OPTIONS))
        if unknown:
            takes = ", ".join(self.OPTIONS) if self.OPTIONS else "no options of its own"
            raise UserError(f"{type(self).__name__} does not take {', '.join(unknown)}; it takes {takes}")
        self.dir, self.project, self.run_name = dir, project, run_name
        self.options = dict(options)

    @abc.abstractmethod
    def open(self, run_id: str | None, config: Mapping[str, Any] | None, drop_from: int | None) -> str:
        """Create a run or continue ``run_id`` (dropping its values at steps >= ``drop_from``); its identity."""

    @abc.abstractmethod
    def log(self, metrics: dict[str, float], step: int, wall_time: float) -> None:
        """Record ``metrics`` at ``step``, logged at ``wall_time`` (where the backend keeps a time)."""

    def flush(self) -> None:  # noqa: B027  (a backend whose writes are durable at once needs nothing)
        """Make every value logged so far durable (called at each checkpoint)."""

    @abc.abstractmethod
    def close(self, summary: Mapping[str, Any] | None) -> None:
        """End the run, keeping ``summary`` (final results) where the backend has a place for it."""


def flatten(values: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested mappings as one level with dotted keys: {"checkpoint": {"keep": 2}} -> {"checkpoint.keep": 2}."""
    flat: dict[str, Any] = {}
    for key, value in values.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(flatten(value, name + "."))
        else:
            flat[name] = value
    return flat


def as_text(values: Mapping[str, Any]) -> str:
    """JSON of ``values``, indented as a Markdown code block (how TensorBoard's text panel shows it)."""
    return "\n".join("    " + line for line in json.dumps(values, indent=2, default=str).splitlines())
