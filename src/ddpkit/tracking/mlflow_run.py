"""MLflow: one MLflow run, through ``mlflow.MlflowClient`` on a tracking URI.

The tracking URI is the ``tracking_uri`` option, else ``$MLFLOW_TRACKING_URI``
(as MLflow users set it), else ``sqlite:///<dir>/mlflow.db``: a real SQLite
database through SQLAlchemy, as ``mlflow ui --backend-store-uri`` reads it.
The run belongs to the experiment ``project`` (created when missing); the
hyperparameters are its params (nested keys dotted: ``checkpoint.keep``),
logged once; a summary's scalars become tags ``summary.<key>``. Every
``log`` call is one committed ``log_batch``, durable at once.

A resumed run continues the same run (its status set back to RUNNING) and
first deletes the values the run holds at steps >= the first step it logs,
with MLflow's own table models on the same database (MLflow has no call
that deletes metric values; ``latest_metrics``, what the runs table shows,
is recomputed from what remains). That needs a database tracking URI
(``sqlite:``, ``postgresql:``, ``mysql:``, ``mssql:``); with a tracking
server (``http:``) or a ``file:`` store nothing can be deleted, which is
said in one warning, and the steps logged after the checkpoint by the
stopped run then show twice.
"""

from __future__ import annotations

import contextlib
import logging
import os
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

from ddpkit.log import get_logger
from ddpkit.tracking.backend import Backend, flatten

DATABASES = ("sqlite", "postgresql", "mysql", "mssql")
"""Tracking URI schemes (before any ``+driver``) whose values can be deleted on resume."""

_PARAMS_PER_BATCH = 100  # MLflow's limit of params per log_batch call
_MAX_TAG_LENGTH = 5000


class MlflowRun(Backend):
    """Writes one MLflow run (see the module docstring)."""

    OPTIONS = ("tracking_uri",)

    def open(self, run_id: str | None, config: Mapping[str, Any] | None, drop_from: int | None) -> str:
        """Create the run (and its experiment) or continue ``run_id`` after deleting its values from ``drop_from``."""
        from mlflow import MlflowClient  # (its import sets up its loggers: before _quiet holds them back)

        self.dir.mkdir(parents=True, exist_ok=True)
        self.uri = (
            self.options.get("tracking_uri")
            or os.environ.get("MLFLOW_TRACKING_URI")
            or (f"sqlite:///{(self.dir / 'mlflow.db').resolve()}")
        )
        with _quiet():
            self.client = MlflowClient(tracking_uri=self.uri)
            if run_id is None:
                self.run_id = self._create(config)
            else:
                self.run_id = run_id
                self._continue(drop_from)
        return self.run_id

    def _create(self, config: Mapping[str, Any] | None) -> str:
        from mlflow.entities import Param

        experiment = self.client.get_experiment_by_name(self.project)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(self.project)
        run_id = self.client.create_run(experiment_id, run_name=self.run_name or None).info.run_id
        params = [Param(key, str(value)) for key, value in flatten(config or {}).items()]
        for start in range(0, len(params), _PARAMS_PER_BATCH):
            self.client.log_batch(run_id, params=params[start : start + _PARAMS_PER_BATCH])
        return str(run_id)

    def _continue(self, drop_from: int | None) -> None:
        if drop_from is not None:
            if _scheme(self.uri) in DATABASES:
                delete_from_step(self.uri, self.run_id, drop_from)
            else:
                get_logger().warning(
                    f"tracking: MLflow at {self.uri} has no way to delete metric values: steps >= {drop_from} that "
                    "the stopped run logged after the checkpoint show beside this run's (use a database tracking "
                    "URI, e.g. sqlite:///mlflow.db, for an exact resume)"
                )
        if self.client.get_run(self.run_id).info.status != "RUNNING":
            self.client.update_run(self.run_id, status="RUNNING")

    def log(self, metrics: dict[str, float], step: int, wall_time: float) -> None:
        """One log_batch of every metric at ``step``."""
        from mlflow.entities import Metric

        now = int(wall_time * 1000)
        with _quiet():
            self.client.log_batch(
                self.run_id, metrics=[Metric(key, value, now, step) for key, value in metrics.items()]
            )

    def close(self, summary: Mapping[str, Any] | None) -> None:
        """Tag the summary's scalars and mark the run FINISHED."""
        with _quiet():
            for key, value in flatten(summary or {}).items():
                if isinstance(value, (int, float, str, bool)):
                    self.client.set_tag(self.run_id, f"summary.{key}", str(value)[:_MAX_TAG_LENGTH])
            self.client.set_terminated(self.run_id, "FINISHED")


def delete_from_step(uri: str, run_id: str, step: int) -> None:
    """Delete every metric value of ``run_id`` at ``step`` or later and recompute its latest values (one transaction)."""
    from mlflow.store.tracking.dbmodels.models import SqlLatestMetric, SqlMetric
    from sqlalchemy import create_engine, delete, select
    from sqlalchemy.orm import Session

    # MLflow's models declare plain Column attributes (SQLAlchemy 1.x style): the type checker reads a
    # comparison as a bool and a row's field as a Column, hence the ignores and the str() of a key.
    engine = create_engine(uri)
    try:
        with Session(engine) as session, session.begin():
            session.execute(
                delete(SqlMetric).where(SqlMetric.run_uuid == run_id, SqlMetric.step >= step)  # type: ignore[arg-type]
            )
            session.execute(delete(SqlLatestMetric).where(SqlLatestMetric.run_uuid == run_id))
            rows = session.execute(select(SqlMetric).where(SqlMetric.run_uuid == run_id)).scalars()
            latest: dict[str, Any] = {}
            for row in rows:  # MLflow's order: the highest step, then the newest, then the largest value
                key = str(row.key)
                if key not in latest or _rank(row) > _rank(latest[key]):
                    latest[key] = row
            session.add_all(
                SqlLatestMetric(
                    key=row.key,
                    value=row.value,
                    timestamp=row.timestamp,
                    step=row.step,
                    is_nan=row.is_nan,
                    run_uuid=run_id,
                )
                for row in latest.values()
            )
    finally:
        engine.dispose()


def _rank(row: Any) -> tuple[int, int, bool, float]:
    return row.step, row.timestamp, not row.is_nan, row.value


def _scheme(uri: str) -> str:
    return uri.split(":", 1)[0].split("+", 1)[0].lower()


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Hold back MLflow's and Alembic's own log lines (schema creation, a failed call's traceback: the Tracker
    reports a failure in one line) and the deprecation warnings MLflow's store raises in SQLAlchemy (nothing
    a user of ddpkit can act on)."""
    loggers = [logging.getLogger(name) for name in ("mlflow", "alembic")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.CRITICAL + 1)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)
