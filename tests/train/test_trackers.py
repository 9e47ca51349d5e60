"""``ddpkit train logger=mlflow|wandb`` end to end: a worker killed mid-run, restarted, one tracked run.

The job (tests/train/checkpoint_helpers.py: 2 workers, 2 epochs of 16 steps,
a checkpoint every 4) logs every 2 steps; rank 1 is SIGKILLed at step 23, after
the checkpoint of step 20 and the metrics of step 22, and ``max_restarts=1``
resumes it. Read back with the backend's own reader, the tracked run has the
numbers of ``metrics.jsonl`` at each of its steps once, and the config as its
hyperparameters. The jobs run in this process, their workers forked from one
worker server.
"""

from __future__ import annotations

import json

import pytest

from tests.helpers.launch_in_process import Commands
from tests.tracking.readers import READERS, mlflow_client, wandb_records
from tests.train.checkpoint_helpers import run_job_here

pytestmark = pytest.mark.slow

KINDS = ("mlflow", "wandb")


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    """Each kind's job: (its output folder, its result)."""
    results = {}
    with Commands() as commands:
        for kind in KINDS:
            folder = tmp_path_factory.mktemp(kind)
            out = run_job_here(
                commands,
                folder,
                "max_restarts=1",
                "log_every=2",
                f"logger={kind}",
                env={"DDPKIT_TEST_SIGNAL_STEP": "23", "DDPKIT_TEST_SIGNAL": "SIGKILL"},
            )
            results[kind] = (folder, out)
    return results


def _expected(folder) -> dict[str, list[int]]:
    """Every metric of metrics.jsonl's train and eval lines, by tracked name: its steps, each once."""
    steps: dict[str, set[int]] = {}
    for row in (folder / "metrics.jsonl").read_text().splitlines():
        line = json.loads(row)
        prefix = {"train": "train", "eval": line.get("split")}.get(line["event"])
        for key, value in line.items():
            if prefix and key not in ("event", "time", "global_step", "split") and isinstance(value, (int, float)):
                steps.setdefault(f"{prefix}/{key}", set()).add(line["global_step"])
    return {name: sorted(values) for name, values in steps.items()}


@pytest.mark.parametrize("kind", KINDS)
def test_restarted_job_continues_one_tracked_run(kind, jobs):
    folder, out = jobs[kind]
    assert out.returncode == 0, out.stderr[-3000:]
    assert "restart 1: resuming from the newest checkpoint" in out.stderr, out.stderr[-3000:]
    expected = _expected(folder)
    assert expected["train/loss"] == list(range(2, 33, 2)) and expected["test/accuracy"] == [16, 32]
    series, run_ids = READERS[kind](folder)
    assert series == expected
    assert len(run_ids) == 1


def test_config_is_the_hyperparameters(jobs):
    client = mlflow_client(jobs["mlflow"][0])
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert run.data.params["model"] == "tests.train.checkpoint_helpers:signalled"
    assert run.data.params["checkpoint.every_steps"] == "4" and run.info.status == "FINISHED"
    assert run.data.tags["summary.global_steps"] == "32"
    first = sorted((jobs["wandb"][0] / "wandb").glob("offline-run-*"))[0]
    config = next(record["run"]["config"]["update"] for record in wandb_records(first) if record["type"] == "run")
    assert config["model"] == "tests.train.checkpoint_helpers:signalled" and config["checkpoint"]["every_steps"] == 4
