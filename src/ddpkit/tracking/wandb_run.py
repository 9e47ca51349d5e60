"""Weights & Biases: one W&B run, offline unless told otherwise (``wandb sync`` uploads it later).

``wandb.init`` is called as a user calls it: the project, ``dir`` (the run's
files go to ``<dir>/wandb/offline-run-<time>-<id>/``), the hyperparameters
as its config (first segment only), and ``mode``: the ``mode`` option, else
``$WANDB_MODE``, else ``offline`` (no account needed).

Rows. W&B keeps one row per ``_step`` and takes no row at a step it has
passed, also not after a resume; but a loop may log a step in two calls with
a checkpoint between them (the step's loss, the checkpoint, then the epoch's
evaluation at the same step). So each ``log`` call is its own row, at
``_step = step * 1000 + (calls at that step so far)``, with the step itself
as the metric ``step``, every chart's x axis (``define_metric("*",
step_metric="step")``, W&B's way to log on an axis of one's own): up to
1000 calls per step. W&B writes a row when the next one begins, and its
offline file every ``flush_seconds`` (1 s here; W&B's default is 15).

Checkpoints: W&B has no call that makes what was logged durable except
``finish``. So at each checkpoint rank 0 finishes the run's current segment
(every row so far is then in its ``.wandb`` file) and the next ``log`` opens
the next segment of the same run (``resume="allow"``); a segment costs about
0.1 s. A resumed run opens its first segment with
``resume_from="<id>?_step=<s * 1000 - 1>"``, s being the first step it logs:
W&B's rewind, which drops the run's rows from step s on (what the stopped run
logged after the checkpoint) before the new rows. ``wandb sync <dir>/wandb``
uploads the segments of a run in the order they started (W&B groups them by
run id), applying each rewind; the rewind is W&B's server feature.

Limit: a hard kill loses what W&B had not yet written: the rows of the last
``flush_seconds`` and the newest step's row. Rows after the newest checkpoint
are logged again by the resumed run, except those at steps before its first
one (an evaluation logged just after an epoch-end checkpoint): those are lost
if the kill came within that second. A preemption (SIGTERM...) writes a
checkpoint first, so loses nothing.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from ddpkit.tracking.backend import Backend

ROWS_PER_STEP = 1000
"""Rows (log calls) one step may have: a row's ``_step`` is ``step * ROWS_PER_STEP + call``."""
STEP_METRIC = "step"
"""The metric that holds each row's step: the x axis of every chart."""
FLUSH_SECONDS = 1.0
"""Default seconds between W&B's writes of its offline file (``x_transaction_log_flush_interval``)."""


class WandbRun(Backend):
    """Writes one W&B run in segments (see the module docstring)."""

    OPTIONS = ("mode", "entity", "group", "tags", "flush_seconds")

    def open(self, run_id: str | None, config: Mapping[str, Any] | None, drop_from: int | None) -> str:
        """``wandb.init`` a new run, or the same run again (rewound to before ``drop_from``)."""
        self.last_step, self.calls = -1, 0
        if run_id is None:
            self.run = self._init(config=dict(config or {}))
        elif drop_from:
            self.run = self._init(resume_from=f"{run_id}?_step={drop_from * ROWS_PER_STEP - 1}")
        else:
            self.run = self._init(id=run_id, resume="allow")
        self.run_id = str(self.run.id)
        return self.run_id

    def _init(self, **how: Any) -> Any:
        import wandb

        self.dir.mkdir(parents=True, exist_ok=True)
        settings: dict[str, Any] = {"console": "off", "silent": True}
        if "x_transaction_log_flush_interval" in wandb.Settings.model_fields:  # wandb >= 0.31
            settings["x_transaction_log_flush_interval"] = float(self.options.get("flush_seconds", FLUSH_SECONDS))
        # (A user's option, which wandb checks: online, offline, disabled or shared.)
        mode: Any = self.options.get("mode") or (None if os.environ.get("WANDB_MODE") else "offline")
        named = {key: self.options[key] for key in ("entity", "group", "tags") if key in self.options}
        run = wandb.init(
            project=self.project,
            dir=str(self.dir),
            name=self.run_name or None,
            mode=mode,
            settings=wandb.Settings(**settings),
            **named,
            **how,
        )
        run.define_metric(STEP_METRIC)
        run.define_metric("*", step_metric=STEP_METRIC)
        return run

    def log(self, metrics: dict[str, float], step: int, wall_time: float) -> None:
        """``run.log`` at ``step`` (in a new segment of the run after a checkpoint)."""
        if self.run is None:
            self.run = self._init(id=self.run_id, resume="allow")
        self.calls = self.calls + 1 if step == self.last_step else 0
        self.last_step = step
        if self.calls >= ROWS_PER_STEP:
            raise ValueError(
                f"more than {ROWS_PER_STEP} log calls at step {step}; W&B rows of a step run out: "
                "log a step's metrics in fewer calls"
            )
        self.run.log({**metrics, STEP_METRIC: step}, step=step * ROWS_PER_STEP + self.calls)

    def flush(self) -> None:
        """Finish the current segment: every row logged so far is in its file."""
        if self.run is not None:
            self.run.finish()
            self.run = None

    def close(self, summary: Mapping[str, Any] | None) -> None:
        """Put ``summary`` in the run's summary and finish it."""
        if self.run is None:
            self.run = self._init(id=self.run_id, resume="allow")
        if summary:
            self.run.summary.update(dict(summary))
        self.run.finish()
        self.run = None
