"""ddpkit.Tracker in one process and on 2 gloo ranks: input checks, rank 0 alone writing, the resume rule, failures.

The whole story (a loop killed and restarted under ``ddpkit run``, every
backend read back by its own reader) is tests/tracking/test_own_loop.py.
"""

from __future__ import annotations

import sys

import pytest
import torch

import ddpkit
from ddpkit.commands.dispatch import main
from tests.helpers.workers import run_on_ranks
from tests.tracking.readers import READERS
from tests.train.checkpoint_helpers import LogRecords


def test_unknown_kind_names_the_kinds():
    with pytest.raises(
        ddpkit.UserError,
        match=r"^Tracker kind 'neptune' is not known; choose one of: csv, jsonl, mlflow, "
        r"tensorboard, wandb$",
    ):
        ddpkit.Tracker("neptune")


@pytest.mark.parametrize("kind, package", [("wandb", "wandb"), ("mlflow", "mlflow"), ("tensorboard", "tensorboard")])
def test_missing_package_is_one_line_naming_the_extra(kind, package, monkeypatch):
    monkeypatch.setitem(sys.modules, package, None)  # as without the extra: `import package` fails
    with pytest.raises(ddpkit.UserError) as error:
        ddpkit.Tracker(kind)
    assert str(error.value) == (
        f"Tracker({kind!r}) needs the {package} package, which is not installed; pip install 'ddpkit[{kind}]'"
    )


def test_train_without_the_package_fails_before_any_worker(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "mlflow", None)
    monkeypatch.chdir(tmp_path)
    words = ["dataset=synthetic", "synthetic_samples=256", "epochs=1", "device=cpu", "logger=mlflow", "output_dir=run"]
    assert main(["train", "nproc=2", *words]) == 2
    assert capsys.readouterr().err == (
        "error: logger=mlflow needs the mlflow package, which is not installed; "
        "pip install 'ddpkit[mlflow]', or use logger=jsonl\n"
    )
    assert not (tmp_path / "run").exists()  # no worker started, nothing written


def test_bad_input_is_one_line(tmp_path):
    with pytest.raises(ddpkit.UserError, match=r"^CsvLog does not take tracking_uri; it takes no options of its own$"):
        ddpkit.Tracker("csv", tmp_path, tracking_uri="sqlite:///x.db")
    tracker = ddpkit.Tracker("csv", tmp_path)
    with pytest.raises(ddpkit.UserError, match=r"^Tracker.log: metrics\['loss'\] is a str; log numbers"):
        tracker.log({"loss": "low"}, step=1)
    with pytest.raises(ddpkit.UserError, match=r"^Tracker.log: step=1.5 is not an integer"):
        tracker.log({"loss": 1.0}, step=1.5)
    with pytest.raises(ddpkit.UserError, match=r"^Tracker.log: reduce='max' is not valid; choose mean, sum or None$"):
        tracker.log({"loss": 1.0}, step=1, reduce="max")
    tracker.log({"loss": 1.0}, step=2)
    with pytest.raises(ddpkit.UserError, match=r"^Tracker.log: step 1 is below the last step logged \(2\)"):
        tracker.log({"loss": 1.0}, step=1)
    with pytest.raises(ddpkit.UserError, match=r"^Tracker.load_state_dict after log\(\)"):
        tracker.load_state_dict(tracker.state_dict())
    tracker.close()


def _log_on_ranks(rank: int, world_size: int, folder: str) -> dict:
    tracker = ddpkit.Tracker("csv", folder)
    for step in (1, 2):
        tracker.log({"mean": float(rank + step)}, step=step, reduce="mean")
        tracker.log({"sum": torch.tensor(float(rank))}, step=step, reduce="sum")
        tracker.log({"rank": rank}, step=step)  # no reduce: rank 0's value
    state = tracker.state_dict()
    tracker.close()
    return state


def test_two_ranks_rank_zero_writes_the_reduced_values_once(tmp_path):
    states = run_on_ranks(_log_on_ranks, 2, str(tmp_path))
    assert sorted(path.name for path in tmp_path.iterdir()) == ["metrics.csv"]
    rows = (tmp_path / "metrics.csv").read_text().splitlines()
    assert rows == ["step,mean,sum,rank", "1,1.5,,", "1,,1.0,", "1,,,0.0", "2,2.5,,", "2,,1.0,", "2,,,0.0"]
    assert states[0] == {"kind": "csv", "run_id": str(tmp_path / "metrics.csv"), "step": 2}
    assert states[1]["run_id"] is None  # only rank 0 opened a run


@pytest.mark.parametrize("kind", ["csv", "tensorboard", "mlflow"])
def test_resume_replaces_the_steps_it_logs_again_and_keeps_the_others(kind, tmp_path):
    # The stopped run: steps 1-3, a checkpoint, an evaluation at step 3, steps 4-5. The resumed run logs from 4 on.
    first = ddpkit.Tracker(kind, tmp_path, config={"lr": 0.1})
    for step in (1, 2, 3):
        first.log({"loss": float(step)}, step=step)
    checkpoint = first.state_dict()
    first.log({"accuracy": 0.5}, step=3)
    for step in (4, 5):
        first.log({"loss": float(step)}, step=step)
    resumed = ddpkit.Tracker(kind, tmp_path, config={"lr": 0.1})
    resumed.load_state_dict(checkpoint)
    for step in (4, 5, 6):
        resumed.log({"loss": 10.0 + step}, step=step)
    resumed.close()
    series, runs = READERS[kind](tmp_path)
    assert series == {"loss": [1, 2, 3, 4, 5, 6], "accuracy": [3]}
    assert runs == {checkpoint["run_id"]}


def test_a_checkpoint_of_another_kind_starts_a_new_run(tmp_path):
    tracker = ddpkit.Tracker("csv", tmp_path / "b")
    with LogRecords() as logs:
        tracker.load_state_dict({"kind": "mlflow", "run_id": "abc", "step": 7})
    assert logs.warnings() == [
        "tracking: the checkpoint continues mlflow run abc; this run tracks with csv: a new run starts"
    ]
    tracker.log({"loss": 1.0}, step=1)  # not refused: the step count starts afresh
    tracker.close()
    assert READERS["csv"](tmp_path / "b")[0] == {"loss": [1]}


def test_a_failing_backend_is_one_warning_and_logging_goes_on(tmp_path):
    (tmp_path / "taken").write_text("a file where the tracker's folder should be")
    tracker = ddpkit.Tracker("csv", tmp_path / "taken")
    with LogRecords() as logs:
        for step in range(1, 4):
            tracker.log({"loss": 1.0}, step=step)
        state = tracker.state_dict()
        tracker.close()
    assert len(logs.warnings()) == 1
    assert logs.warnings()[0].startswith("tracking: csv failed (FileExistsError: ")
    assert logs.warnings()[0].endswith("tracking is off for the rest of this run; training and its checkpoints go on")
    assert state == {"kind": "csv", "run_id": None, "step": 3}
