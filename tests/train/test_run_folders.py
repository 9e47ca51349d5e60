"""Runs never collide: each fresh run gets its own folder, runs/latest points to it, resume=auto continues it."""

from __future__ import annotations

import json
import os

import pytest

from ddpkit.commands.dispatch import main
from ddpkit.keyvalue import parse
from ddpkit.train.config import TrainConfig
from ddpkit.train.run_folder import LATEST, claim_run_folder, plan_run_folder

TINY = ["dataset=synthetic", "synthetic_samples=256", "batch_size=32", "progress=false", "nproc=1"]
NOON = 1_795_000_000.0  # a fixed time, so that the folder names are known


@pytest.fixture
def here(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    return tmp_path


def cfg(*words: str) -> TrainConfig:
    return parse(TrainConfig, ["dataset=synthetic", *words])


def test_a_fresh_run_gets_a_new_folder_named_by_model_dataset_and_time(here):
    first = plan_run_folder(cfg(), {}, now=NOON)
    assert first.parent.as_posix() == "runs/mlp-synthetic" and len(first.name) == len("20261124-071900")
    claim_run_folder(first)
    assert plan_run_folder(cfg(), {}, now=NOON).name == first.name + "-2"  # the same second: a suffix
    assert plan_run_folder(cfg("output_dir=mine"), {}, now=NOON).as_posix() == "mine"
    assert plan_run_folder(cfg("model=my_models:build"), {}, now=NOON).parent.name == "my_models.build-synthetic"


def test_a_slurm_job_s_ranks_and_its_requeued_runs_share_one_folder(here):
    environ = {"SLURM_JOB_ID": "4242"}
    assert plan_run_folder(cfg(), environ).as_posix() == "runs/mlp-synthetic/slurm-4242"
    assert plan_run_folder(cfg(), {**environ, "SLURM_RESTART_COUNT": "1"}).as_posix() == "runs/mlp-synthetic/slurm-4242"


def test_resume_auto_and_restarts_continue_the_newest_run_of_the_same_model_and_dataset(here):
    assert plan_run_folder(cfg("resume=auto"), {}, now=NOON).name.startswith("2026")  # none yet: a new one
    older = claim_run_folder(plan_run_folder(cfg(), {}, now=NOON))
    newer = claim_run_folder(plan_run_folder(cfg(), {}, now=NOON + 60))
    claim_run_folder(plan_run_folder(cfg("model=cnn"), {}, now=NOON + 120))  # another series: not a candidate
    assert plan_run_folder(cfg("resume=auto"), {}, now=NOON + 180) not in (newer, older)  # no checkpoint to continue
    (newer / "checkpoints" / "step-000000008").mkdir(parents=True)
    (newer / "checkpoints" / "step-000000008" / "manifest.json").write_text("{}")
    assert plan_run_folder(cfg("resume=auto"), {}) == newer != older
    assert plan_run_folder(cfg(), {"TORCHELASTIC_RESTART_COUNT": "1"}) == newer


def test_latest_points_to_the_claimed_run_and_an_old_real_folder_is_left_alone(here):
    run = claim_run_folder(plan_run_folder(cfg(), {}, now=NOON))
    assert LATEST.is_symlink() and LATEST.resolve() == run.resolve()
    assert os.readlink(LATEST) == f"mlp-synthetic/{run.name}"  # relative: the project folder can move
    claim_run_folder(here / "elsewhere")  # outside runs/: latest unchanged
    assert LATEST.resolve() == run.resolve()

    LATEST.unlink()
    LATEST.mkdir()  # runs/latest as an older ddpkit wrote it, a real folder
    claim_run_folder(plan_run_folder(cfg(), {}, now=NOON + 60))
    assert LATEST.is_dir() and not LATEST.is_symlink()


@pytest.mark.slow
def test_train_twice_in_one_folder_then_resume_auto_continues_the_latest(here, capsys):
    assert main(["train", *TINY, "epochs=1"]) == 0
    first = LATEST.resolve()
    assert main(["train", *TINY, "epochs=1"]) == 0  # the same command again: a new run, not a refusal
    second = LATEST.resolve()
    assert first != second and first.parent == second.parent == here / "runs" / "mlp-synthetic"
    capsys.readouterr()

    assert main(["train", *TINY, "epochs=2", "resume=auto"]) == 0
    err = capsys.readouterr().err
    assert (
        f"resumed from runs/mlp-synthetic/{second.name}/checkpoints/step-000000008 (global step 8: "
        "1 epoch(s) complete)" in err
    ), err
    assert LATEST.resolve() == second
    summary = json.loads((second / "summary.json").read_text())
    assert (summary["epochs"], summary["global_steps"]) == (2, 16)
    assert json.loads((first / "summary.json").read_text())["epochs"] == 1  # the first run is untouched
    assert f"run folder runs/mlp-synthetic/{second.name}" in err

    # Once more: the run is finished; its train time and throughput are those of the two epochs it trained.
    assert main(["train", *TINY, "epochs=2", "resume=auto"]) == 0
    assert "this run is finished: all 2 epochs are complete" in capsys.readouterr().err
    finished = json.loads((second / "summary.json").read_text())
    assert finished["train_time_s"] == pytest.approx(summary["train_time_s"], rel=0.2)
    assert finished["samples_per_s"] == pytest.approx(summary["samples_per_s"], rel=0.2)


@pytest.mark.parametrize("resume", ["never", "auto"])
def test_a_fresh_run_never_writes_into_another_run_s_files_nor_beside_other_files(here, capsys, resume):
    """Without a checkpoint to continue, a run refuses a folder holding another run (its metrics.jsonl and
    summary.json would get this run's lines), or other files (output_dir=/etc), in one line; a new folder works."""
    words = [*TINY, "epochs=1", "checkpoint.enabled=false"]
    assert main(["train", *words, "output_dir=first"]) == 0
    metrics, summary = (here / "first" / "metrics.jsonl").read_text(), (here / "first" / "summary.json").read_text()
    capsys.readouterr()
    assert main(["train", *words, "output_dir=first", f"resume={resume}"]) == 2
    err = capsys.readouterr().err
    assert err == (
        "error: output_dir first holds another run (metrics.jsonl, summary.json, .ddpkit.lock) with no checkpoint "
        "to continue; start this run in a new folder (another output_dir=..., or none for a new one under runs/) "
        "or remove that run\n"
    ), err
    assert (here / "first" / "metrics.jsonl").read_text() == metrics
    assert (here / "first" / "summary.json").read_text() == summary
    (here / "things").mkdir()
    (here / "things" / "notes.txt").write_text("mine")
    assert main(["train", *words, "output_dir=things"]) == 2
    assert capsys.readouterr().err == (
        "error: output_dir things is not empty (notes.txt) and holds no ddpkit run; choose a new or empty folder "
        "(output_dir=...), or none for a new one under runs/\n"
    )
    assert sorted(path.name for path in (here / "things").iterdir()) == ["notes.txt"]
    (here / "empty").mkdir()
    assert main(["train", *words, "output_dir=empty"]) == 0
