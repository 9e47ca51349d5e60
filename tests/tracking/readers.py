"""Each backend's tracked run read back with the backend's own reader: metric name -> the steps it has, in order.

Every reader also returns the run identities it found, so that a test can
check that a resumed run continued one run.
"""

from __future__ import annotations

import csv
import functools
import json
import subprocess
import sys
from pathlib import Path


def csv_series(folder: Path) -> tuple[dict[str, list[int]], set[str]]:
    """metrics.csv through the csv module: each metric's steps (rows where its cell is filled)."""
    series: dict[str, list[int]] = {}
    with open(folder / "metrics.csv", newline="") as f:
        for row in csv.DictReader(f):
            for name, value in row.items():
                if name != "step" and value != "":
                    series.setdefault(name, []).append(int(row["step"]))
    return series, {str(folder / "metrics.csv")}


def tensorboard_series(folder: Path) -> tuple[dict[str, list[int]], set[str]]:
    """The event files through TensorBoard's EventAccumulator (which applies purge steps as TensorBoard does)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder))
    events.Reload()
    return {tag: [event.step for event in events.Scalars(tag)] for tag in events.Tags()["scalars"]}, {str(folder)}


def mlflow_series(folder: Path) -> tuple[dict[str, list[int]], set[str]]:
    """The SQLite store through MLflow's client: every run's metric histories (one run expected)."""
    client = mlflow_client(folder)
    runs = client.search_runs([experiment.experiment_id for experiment in client.search_experiments()])
    series: dict[str, list[int]] = {}
    for run in runs:
        for key in run.data.metrics:
            history = client.get_metric_history(run.info.run_id, key)
            series.setdefault(key, []).extend(sorted(metric.step for metric in history))
    return series, {run.info.run_id for run in runs}


def mlflow_client(folder: Path):
    """MLflow's client on the run's SQLite database."""
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=f"sqlite:///{folder / 'mlflow.db'}")


@functools.cache
def wandb_records(segment: Path) -> list[dict]:
    """The records of one offline run folder, through W&B's own reader (``wandb leet inspect --json``; read once)."""
    out = subprocess.run(
        [sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(segment)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return [json.loads(line) for line in out.stdout.splitlines() if line.strip()]


def wandb_series(folder: Path) -> tuple[dict[str, list[int]], set[str]]:
    """The offline run folders under ``<folder>/wandb``, replayed as ``wandb sync`` uploads them.

    The segments of a run in the order they started; a segment that rewinds
    (``resume_from``: its run record's ``branch_point``) first drops the rows
    after the ``_step`` it names; then its history rows are added. Each row's
    step is its ``step`` metric (the charts' x axis).
    """
    segments = []
    for path in sorted((folder / "wandb").glob("offline-run-*")):
        records = wandb_records(path)
        run = next((record["run"] for record in records if record["type"] == "run"), None)
        if run is None:  # killed before W&B first wrote its file: the segment holds nothing
            continue
        rows = [record["history"]["item"] for record in records if record["type"] == "history"]
        segments.append((run["start_time"], run["run_id"], run.get("branch_point"), rows))
    history: dict[int, dict] = {}
    for _, _, branch_point, rows in sorted(segments, key=lambda segment: segment[0]):
        if branch_point:
            history = {step: row for step, row in history.items() if step <= branch_point["value"]}
        for row in rows:
            assert row["_step"] not in history, f"step {row['_step']} written twice"
            history[row["_step"]] = row
    series: dict[str, list[int]] = {}
    for row_step in sorted(history):
        row = history[row_step]
        for key in row:
            if not key.startswith("_") and key != "step":
                series.setdefault(key, []).append(row["step"])
    return series, {run_id for _, run_id, _, _ in segments}


def jsonl_series(folder: Path) -> tuple[dict[str, list[int]], set[str]]:
    """metrics.jsonl line by line (every line, as written: no later line hides an earlier one): a train line's
    metrics by their names, an eval line's as ``<split>_<name>`` (test_accuracy)."""
    series: dict[str, list[int]] = {}
    for row in (folder / "metrics.jsonl").read_text().splitlines():
        line = json.loads(row)
        if line["event"] not in ("train", "eval"):
            continue
        prefix = "" if line["event"] == "train" else line["split"] + "_"
        for name in line:
            if name not in ("event", "time", "global_step", "split"):
                series.setdefault(prefix + name, []).append(line["global_step"])
    return series, {str(folder / "metrics.jsonl")}


READERS = {
    "csv": csv_series,
    "jsonl": jsonl_series,
    "tensorboard": tensorboard_series,
    "mlflow": mlflow_series,
    "wandb": wandb_series,
}
"""Each backend's reader, by Tracker kind."""
