"""The metrics the checkpoints carry: what ``epoch_end()`` gave, which checkpoint each belongs to, the best.

``epoch_end(metrics)`` may come before its checkpoint is written (with a loader, the epoch's checkpoint waits
for the next step boundary), after it (a ``save()`` of the same step), or never (a loop that gives no
metrics). This part keeps each case's metrics until the right checkpoint takes them, and says once, on rank 0,
when ``best_metric`` was set and no metrics carry it.
"""

from __future__ import annotations

from collections.abc import Mapping

from ddpkit.checkpoint.manager.advice import SaidOnce, no_best_metric
from ddpkit.checkpoint.manager.best import BestMetric

__all__ = ["CheckpointMetrics"]

Metrics = tuple[dict[str, float], bool]
"""Metric values and whether they made the checkpoint the best."""


def _none() -> Metrics:
    """No metrics: a new dict each time, so that no two holders share (and could change) one."""
    return {}, False


class CheckpointMetrics:
    """The metrics of the newest checkpoint's step, those waiting for the epoch's checkpoint, and the best."""

    def __init__(self, best: BestMetric, told: SaidOnce) -> None:
        self.best = best
        """The best value of ``best_metric`` so far, which picks the ``best-*`` checkpoint."""
        self.epoch_ends = 0
        """``epoch_end()`` calls in this process."""
        self._told = told
        self._step: Metrics = _none()  # of the newest checkpoint's step: a replacement of it keeps them
        self._pending: Metrics = _none()  # for the epoch's checkpoint still to be written

    def given(self, metrics: Mapping[str, float] | None) -> Metrics:
        """An ``epoch_end(metrics)`` call: the values, and whether they improve the best (which then takes them)."""
        values = dict(metrics or {})
        self.epoch_ends += 1
        self._told.say("best_metric", no_best_metric(self.best.metric, values))
        return values, self.best.improves(values)

    def add_to_written(self, values: dict[str, float], improved: bool) -> None:
        """The metrics given after this step's checkpoint was written (its manifest gets them too)."""
        self._step = (values, improved or self._step[1])

    def wait_for_checkpoint(self, values: dict[str, float], improved: bool) -> None:
        """The metrics of the epoch's checkpoint, written at the next step boundary."""
        self._pending = (values, improved)

    def take_pending(self, pending: bool, reason: str) -> Metrics:
        """What a checkpoint written for ``reason`` carries: the waiting metrics when it is the one (``pending``)."""
        metrics = self._pending if pending else _none()
        if reason == "epoch_end" and not self.epoch_ends:  # an epoch ended, no metrics came
            self.say_none_given()
        self._pending = _none()
        return metrics

    def for_write(self, replacing: bool, metrics: Mapping[str, float] | None, best: bool) -> Metrics:
        """A checkpoint's metrics: those given, else, replacing this step's checkpoint, those it carried."""
        if replacing and metrics is None:
            return dict(self._step[0]), best or self._step[1]
        return dict(metrics or {}), best

    def written(self, metrics: Metrics) -> None:
        """A checkpoint was written (or resumed from) with ``metrics``."""
        self._step = metrics

    def say_none_given(self) -> None:
        """``best_metric`` is set and no ``epoch_end()`` gave it (once, rank 0)."""
        self._told.say("best_metric", no_best_metric(self.best.metric, None))

    def say_if_never_given(self, epochs_unknown: bool) -> None:
        """At the end: ``best_metric`` is set, no value of it came, no ``epoch_end()`` was called, and no
        loader told where epochs end (``epochs_unknown``): :meth:`say_none_given`."""
        if self.best.metric and self.best.value is None and not self.epoch_ends and epochs_unknown:
            self.say_none_given()
