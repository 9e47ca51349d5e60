"""Experiment tracking from any loop, continued across restarts: :class:`ddpkit.Tracker`.

One backend per file behind one small interface (:mod:`ddpkit.tracking.backend`):
``csv_log`` (CSV), ``tensorboard_events`` (TensorBoard), ``mlflow_run`` (MLflow),
``wandb_run`` (Weights & Biases); :mod:`ddpkit.tracking.backends` names them and
the package each needs. Each backend's module docstring says how it continues
a run after a restart and what it cannot do.
"""

from ddpkit.tracking.tracker import Tracker

__all__ = ["Tracker"]
