"""``ddpkit.Tracker``: experiment tracking from any training loop, continued across restarts.

Every rank calls it at the same points; rank 0 alone creates the run and
writes; a checkpoint holds the run's identity, so a resumed run continues the
same tracked run::

    tracker = ddpkit.Tracker("mlflow", "runs/mine", project="mnist", config=vars(args))
    ckpt = ddpkit.Checkpointer("runs/mine", model=model, optimizer=opt, loader=loader,
                               extra={"tracker": tracker})
    start = ckpt.resume("auto")                  # a resumed run continues the same tracked run
    for epoch in range(start.epoch, epochs):
        for x, y in loader:
            ...
            ckpt.step()
            tracker.log({"loss": loss}, step=ckpt.global_step, reduce="mean")
        tracker.log({"test_accuracy": evaluate()}, step=ckpt.global_step)
    tracker.close()

Backends (``kind``, one file each): ``csv``, ``jsonl`` (``metrics.jsonl`` as
``ddpkit train`` writes it, which ``ddpkit plot`` draws), ``tensorboard``,
``mlflow``, ``wandb`` (:mod:`ddpkit.tracking.backends`).

Resume. ``state_dict()`` (which the Checkpointer calls at every save) makes
everything logged so far durable and returns the run's identity and the last
step logged. After ``load_state_dict()``, the first ``log`` at step s first
removes every value the run holds at steps >= s (what the stopped run logged
after the checkpoint, which this run logs again), then logs: each step once,
none missing. Values the stopped run logged after the checkpoint at steps
before s (an evaluation logged just after an epoch-end checkpoint) are kept.

A failing backend (a read-only database, a full disk) is one warning; tracking
is then off for the rest of the process (not retried: a broken store would
fail, and slow, every step), and training and its checkpoints go on.
"""

from __future__ import annotations

import functools
import importlib
import operator
import os
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from ddpkit.errors import UserError
from ddpkit.log import get_logger
from ddpkit.tracking.backend import Backend
from ddpkit.tracking.backends import BACKENDS, backend_class, install_hint

REDUCE_OPS = ("mean", "sum")
"""How ``log(..., reduce=)`` combines the ranks' values."""


class Tracker:
    """One tracked run (CSV, JSON lines, TensorBoard, MLflow or W&B), written by rank 0; see the module docstring.

    Build it on every rank after ``ddpkit.init()``; pass it to the
    Checkpointer (``extra={"tracker": tracker}``) so that checkpoints hold the
    run's identity.

    Args:
        kind: csv, jsonl (metrics.jsonl, for ``ddpkit plot``; name metrics ``test/accuracy`` for a split),
            tensorboard, mlflow or wandb.
        dir: the folder the backend writes into (CSV file, event files, the MLflow SQLite
            database unless a tracking URI is given, W&B's offline files).
        project: the MLflow experiment or W&B project of the run.
        run_name: the run's name in the backend ("" lets it choose).
        config: hyperparameters, recorded once when the run is created (not again on resume).
        **options: the backend's own: mlflow ``tracking_uri``; wandb ``mode``, ``entity``,
            ``group``, ``tags``, ``flush_seconds``.

    Raises:
        UserError: an unknown kind or option, or the backend's package is not installed
            (the message names the ``pip install 'ddpkit[...]'`` that adds it).
    """

    def __init__(
        self,
        kind: str,
        dir: str | os.PathLike[str] = ".",
        *,
        project: str = "ddpkit",
        run_name: str = "",
        config: Mapping[str, Any] | None = None,
        **options: Any,
    ) -> None:
        check_kind(kind, "Tracker")
        self.kind = kind
        self.config = dict(config) if config is not None else None
        self.rank, self.world_size = _rank_and_size()
        backend = backend_class(kind)(Path(dir), project, run_name, options)
        self._backend: Backend | None = backend if self.rank == 0 else None
        self.run_id: str | None = None
        """The tracked run's identity (rank 0, or any rank after a resume); None before it is created."""
        self.step: int | None = None
        """The last step logged (every rank counts it)."""
        self._resumed = False
        self._opened = False
        self._failed = False

    # -- logging ------------------------------------------------------------------

    def start(self) -> None:
        """Create the run now, rather than at the first ``log`` (optional; rank 0 acts, any rank may call).

        What creating it costs (importing the backend, creating an MLflow database: seconds) then
        falls before training. A resumed run is continued at its first ``log``, whose step says
        from where the stopped run's values are replaced; its backend is imported now.
        """
        if self._backend is None or self._failed:
            return
        if self._resumed:
            for package in BACKENDS[self.kind].packages:
                self._guard(functools.partial(importlib.import_module, package))
        else:
            self._guard(lambda: self._open(drop_from=None))

    def log(self, metrics: Mapping[str, Any], step: int, *, reduce: str | None = None) -> None:
        """Record ``metrics`` at ``step``: call it on every rank; rank 0 writes.

        Args:
            metrics: name -> number (an int, a float, or a one-element tensor).
            step: the step they belong to (e.g. the global step); never below the last one logged.
            reduce: None (rank 0's values), or mean / sum over the ranks: an all_reduce, so every
                rank must call ``log`` with the same names.

        Raises:
            UserError: a value that is not a number, a step below the last one, an unknown reduce.
        """
        wall_time = time.time()
        step = self._check_step(step)
        values = _numbers(metrics)
        if reduce is not None:
            values = _reduce(values, reduce, self.world_size)
        self.step = step
        if self._backend is not None and not self._failed:
            self._guard(lambda: self._write(values, step, wall_time))

    def _check_step(self, given: Any) -> int:
        try:
            step = operator.index(given)
        except TypeError:
            raise UserError(
                f"Tracker.log: step={given!r} is not an integer; pass the step number (e.g. the global step)"
            ) from None
        if step < 0 or (self.step is not None and step < self.step):
            raise UserError(
                f"Tracker.log: step {step} is below the last step logged ({self.step}); log "
                "steps in increasing order (one step may take several calls)"
            )
        return step

    def _write(self, values: dict[str, float], step: int, wall_time: float) -> None:
        self._open(drop_from=step)
        assert self._backend is not None  # rank 0, which alone writes, has one
        self._backend.log(values, step, wall_time)

    def _open(self, drop_from: int | None) -> None:
        """Rank 0, before the first write: create the run, or continue the resumed one (dropping from ``drop_from``)."""
        if self._opened:
            return
        assert self._backend is not None  # rank 0, which alone writes, has one
        if self._resumed:
            self.run_id = self._backend.open(self.run_id, None, drop_from)
            get_logger().info(f"tracking: {self.kind} run {self.run_id} continues at step {drop_from}")
        else:
            self.run_id = self._backend.open(None, self.config, None)
            get_logger().info(f"tracking: {self.kind} run {self.run_id}")
        self._opened = True

    def _guard(self, call: Callable[[], Any]) -> None:
        """Run a backend call; on failure, warn once and turn tracking off (training goes on)."""
        try:
            call()
        except Exception as error:  # any failure of the backend: tracking must never stop training
            self._failed = True
            detail = (str(error).strip().splitlines() or [""])[0][:300]
            get_logger().warning(
                f"tracking: {self.kind} failed ({type(error).__name__}: {detail}); tracking is "
                "off for the rest of this run; training and its checkpoints go on"
            )

    # -- checkpoints ------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The run's identity and last step, once what was logged is durable (the Checkpointer calls it)."""
        if self._backend is not None and self._opened and not self._failed:
            self._guard(self._backend.flush)
        return {"kind": self.kind, "run_id": self.run_id, "step": self.step}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue the tracked run of a checkpoint (``state_dict()``'s output); call it before logging.

        A checkpoint of another kind of tracker (or without a run) starts a new run, with a warning.

        Raises:
            UserError: called after values were logged.
        """
        if self.step is not None or self._opened:
            raise UserError(
                "Tracker.load_state_dict after log(): resume the checkpoint (Checkpointer.resume) before logging"
            )
        if state.get("run_id") is None:
            return
        if state.get("kind") != self.kind:
            if self.rank == 0:
                get_logger().warning(
                    f"tracking: the checkpoint continues {state.get('kind')} run "
                    f"{state.get('run_id')}; this run tracks with {self.kind}: a new run starts"
                )
            return
        self.run_id, self.step, self._resumed = state["run_id"], state.get("step"), True

    def close(self, summary: Mapping[str, Any] | None = None) -> None:
        """End the run (call it on every rank at the end of training).

        Args:
            summary: final results kept with the run where the backend has a place for them (TensorBoard:
                text ``summary``; MLflow: tags ``summary.<key>``; W&B: the run summary; CSV: not kept).
        """
        backend, last_step = self._backend, self.step
        if backend is None or self._failed:
            return
        if not self._opened and self._resumed and last_step is not None:
            self._guard(lambda: self._open(drop_from=last_step + 1))
        if self._opened and not self._failed:
            self._guard(lambda: backend.close(dict(summary) if summary else None))
        self._opened, self._backend = False, None


def check_kind(kind: str, what: str) -> None:
    """Raise UserError unless ``kind`` is a tracking backend whose package is installed.

    Args:
        kind: the backend's name.
        what: how the user named it, for the message.
    """
    if kind not in BACKENDS:
        raise UserError(f"{what} kind {kind!r} is not known; choose one of: {', '.join(sorted(BACKENDS))}")
    hint = install_hint(kind)
    if hint is not None:
        raise UserError(f"{what}({kind!r}) needs {hint}")


def _numbers(metrics: Mapping[str, Any]) -> dict[str, float]:
    if not isinstance(metrics, Mapping):
        raise UserError(f"Tracker.log: metrics is a {type(metrics).__name__}; pass a dict of name -> number")
    values = {}
    for name, value in metrics.items():
        try:
            if isinstance(value, (str, bytes)):
                raise TypeError
            values[str(name)] = float(value.detach() if hasattr(value, "detach") else value)
        except (TypeError, ValueError, RuntimeError):
            raise UserError(
                f"Tracker.log: metrics[{name!r}] is a {type(value).__name__}; log numbers (an int, a "
                "float or a one-element tensor)"
            ) from None
    return values


def _reduce(values: dict[str, float], op: str, world_size: int) -> dict[str, float]:
    if op not in REDUCE_OPS:
        raise UserError(f"Tracker.log: reduce={op!r} is not valid; choose mean, sum or None")
    if world_size == 1:
        return values
    import torch
    import torch.distributed as dist

    from ddpkit.distributed import control_device

    names = sorted(values)
    total = torch.tensor([values[name] for name in names], dtype=torch.float64, device=control_device())
    dist.all_reduce(total)
    if op == "mean":
        total /= world_size
    return dict(zip(names, total.tolist()))


def _rank_and_size() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1
