"""TensorBoard: event files in ``<dir>``, written through ``torch.utils.tensorboard``.

Each metric is a scalar series (its tag is the metric's name); the
hyperparameters are the text ``config`` at step 0 and a summary the text
``summary`` at the last step logged. Events are flushed after every ``log``
call. A resumed run opens a new events file in the same folder with
``purge_step`` set to the first step it logs: TensorBoard's readers then hide
every event of the earlier files at that step or later (what the stopped run
logged after the checkpoint), so each step is shown once.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ddpkit.tracking.backend import Backend, as_text


class TensorBoardEvents(Backend):
    """Writes TensorBoard event files (see the module docstring)."""

    def open(self, run_id: str | None, config: Mapping[str, Any] | None, drop_from: int | None) -> str:
        """A SummaryWriter on ``dir``; the purge step hides the stopped run's later events."""
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(self.dir), purge_step=drop_from)
        self.last_step = 0
        if run_id is None and config:
            self.writer.add_text("config", as_text(config), global_step=0)
            self.writer.flush()
        return str(self.dir)

    def log(self, metrics: dict[str, float], step: int, wall_time: float) -> None:
        """One scalar per metric at ``step``, flushed."""
        for tag, value in metrics.items():
            self.writer.add_scalar(tag, value, global_step=step, walltime=wall_time)
        self.writer.flush()
        self.last_step = step

    def flush(self) -> None:
        """Write what the writer holds."""
        self.writer.flush()

    def close(self, summary: Mapping[str, Any] | None) -> None:
        """Write ``summary`` as the text ``summary`` at the last step and close the writer."""
        if summary:
            self.writer.add_text("summary", as_text(summary), global_step=self.last_step)
        self.writer.close()
