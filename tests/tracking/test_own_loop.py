"""An own loop on 2 ranks tracks 3 epochs; killed after its second, it continues the same tracked run.

For each backend the loop (tests/tracking/own_loop.py) runs under ``ddpkit run
nproc=2 max_restarts=1``; on its first attempt rank 0 SIGKILLs itself 3 steps
into epoch 3 (after the epoch-2 checkpoint, so the killed run has logged steps
that the resumed run logs again). Read back with the backend's own reader
(tests/tracking/readers.py), each metric has exactly one value per step, none
missing, in one run. The jobs run in this process (``ddpkit.commands.dispatch.main``), their
workers forked from one worker server shared by the module.
"""

from __future__ import annotations

import pytest
import yaml

from ddpkit.checkpoint.disk.format import list_checkpoints, verify_checkpoint
from ddpkit.commands.dispatch import main
from ddpkit.train.plot import read_run
from tests.cli_runner import REPO
from tests.helpers.launch_in_process import Commands
from tests.tracking.own_loop import make_writable
from tests.tracking.readers import READERS, mlflow_client, wandb_records

pytestmark = pytest.mark.slow

SCRIPT = str(REPO / "tests" / "tracking" / "own_loop.py")
KILL_AT = 15
"""Rank 0 dies after logging this global step: 3 steps into epoch 3 (6 steps an epoch)."""
EXPECTED = {"loss": list(range(1, 19)), "test_accuracy": [6, 12, 18]}
"""Every step's loss and every epoch's test accuracy, once each."""
READ_ONLY_AT = 8


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every job of this module, by name: (its folder, its result)."""
    # W&B writes its offline file every flush_seconds (0.2 s in own_loop.py): the epoch-2 evaluation, logged after
    # the epoch-2 checkpoint at a step the resumed run does not log again, must be on disk before the kill.
    jobs = {
        kind: ["--kind", kind, "--kill-at", str(KILL_AT), "--pause", "2" if kind == "wandb" else "0"]
        for kind in READERS
    }
    jobs["read_only"] = ["--kind", "mlflow", "--read-only-at", str(READ_ONLY_AT)]
    results = {}
    with Commands() as commands:
        for name, words in jobs.items():
            folder = tmp_path_factory.mktemp(name)
            out = commands.run(
                "run", "nproc=2", "max_restarts=1", SCRIPT, *words, "--out", "job", cwd=folder, clean_environment=True
            )
            results[name] = (folder / "job", out)
    database = results["read_only"][0] / "tracking" / "mlflow.db"
    if database.exists():  # MLflow's client, and pytest's clean-up, need it writable again
        make_writable(database)
    return results


@pytest.mark.parametrize("kind", sorted(READERS))
def test_killed_run_continues_the_same_run_with_each_step_once(kind, runs):
    folder, out = runs[kind]
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.splitlines() == ["attempt 0: from global step 0", "attempt 1: from global step 12"], out.stdout
    series, run_ids = READERS[kind](folder / "tracking")
    assert series == EXPECTED
    assert len(run_ids) == 1, run_ids


def test_hyperparameters_once_and_the_summary(runs):
    config = {"lr": 0.1, "epochs": 3, "seed": 0}
    tracking = runs["csv"][0] / "tracking"
    assert yaml.safe_load((tracking / "hparams.yaml").read_text()) == config
    client = mlflow_client(runs["mlflow"][0] / "tracking")
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert run.data.params == {key: str(value) for key, value in config.items()}
    assert run.info.status == "FINISHED" and run.data.tags["summary.final_accuracy"] == "1.0"
    segments = sorted((runs["wandb"][0] / "tracking" / "wandb").glob("offline-run-*"))
    configs = [
        next(r["run"]["config"]["update"] for r in wandb_records(path) if r["type"] == "run") for path in segments
    ]
    assert {key: value for key, value in configs[0].items() if key != "_wandb"} == config
    assert all(set(later) == {"_wandb"} for later in configs[1:])  # the resumed segments set no config


def test_read_only_database_is_one_warning_and_training_goes_on(runs):
    folder, out = runs["read_only"]
    assert out.returncode == 0, out.stderr[-3000:]
    warnings = [line for line in out.stderr.splitlines() if "tracking:" in line and "failed" in line]
    assert len(warnings) == 1, out.stderr[-3000:]
    assert warnings[0].startswith("[rank 0/2] tracking: mlflow failed (") and warnings[0].endswith(
        "tracking is off for the rest of this run; training and its checkpoints go on"
    ), warnings[0]
    assert "Traceback" not in out.stderr
    checkpoints = list_checkpoints(folder / "checkpoints")
    assert [info.global_step for info in checkpoints] == [12, 18]
    for info in checkpoints:
        verify_checkpoint(info.path)
    series, _ = READERS["mlflow"](folder / "tracking")
    assert series == {"loss": list(range(1, READ_ONLY_AT + 1)), "test_accuracy": [6]}


def test_jsonl_run_of_an_own_loop_is_plotted(runs, tmp_path, capsys):
    """Tracker("jsonl") writes metrics.jsonl as ddpkit train does: ``ddpkit plot`` draws the killed and resumed run."""
    folder = runs["jsonl"][0] / "tracking"
    run = read_run(folder)
    assert [line["global_step"] for line in run.train] == EXPECTED["loss"]
    assert [line["global_step"] for line in run.test] == EXPECTED["test_accuracy"]
    assert run.settings == {"lr": 0.1, "epochs": 3, "seed": 0}
    output = tmp_path / "own.png"
    assert main(["plot", str(folder), f"output={output}"]) == 0
    assert capsys.readouterr().out.startswith(f"wrote {output} (1 run(s)")
    assert output.stat().st_size > 10_000
