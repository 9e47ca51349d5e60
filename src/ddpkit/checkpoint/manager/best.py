"""Which checkpoint is the best: the metric and direction chosen, and the best value so far."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

__all__ = ["BestMetric"]


class BestMetric:
    """The best value of ``metric`` so far (``mode`` max or min); ``metric`` "" keeps no best checkpoint.

    A value that is not a finite number (a NaN loss, an infinite one) never
    becomes the best: a diverged run keeps the best checkpoint it had.
    """

    def __init__(self, metric: str, mode: str, value: float | None = None):
        self.metric, self.mode, self.value = metric, mode, value

    def improves(self, metrics: Mapping[str, float]) -> bool:
        """True when ``metrics`` beat the best so far (which then becomes their value)."""
        if not self.metric or self.metric not in metrics:
            return False
        value = float(metrics[self.metric])
        if not math.isfinite(value):
            return False
        best = self.value
        if best is None or (value > best if self.mode == "max" else value < best):
            self.value = value
            return True
        return False

    def info(self) -> dict[str, Any]:
        """The manifest's ``best`` entry: metric, mode and best value."""
        return {"metric": self.metric, "mode": self.mode, "value": self.value}

    def restore(self, info: Mapping[str, Any]) -> None:
        """Take the best value from a checkpoint's manifest entry, when it is of this metric."""
        if info.get("metric") == self.metric:
            self.value = info.get("value")
