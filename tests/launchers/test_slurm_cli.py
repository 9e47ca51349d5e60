"""``ddpkit slurm`` key=value options: the script it prints or writes, and its errors.

Submitting for real is tested against a Slurm cluster in tests/cluster.
"""

from __future__ import annotations

import os
import sys

import pytest

from ddpkit.commands import slurm as slurm_cli
from ddpkit.commands.dispatch import main
from ddpkit.keyvalue import parse
from ddpkit.launchers.sbatch import SbatchSpec, render_sbatch


def run(argv, capsys):
    status = slurm_cli.main(argv)
    out, err = capsys.readouterr()
    return status, out, err


def test_prints_the_script_of_the_options(capsys, tmp_path):
    argv = [
        "nodes=2",
        "tasks_per_node=4",
        "gpus_per_node=4",
        "cpus_per_task=8",
        "partition=gpu",
        "account=proj42",
        "qos=normal",
        "time=2:00:00",
        "launch=torchrun",
        "venv=/home/ada/venv",
        f"project_root={tmp_path}",
        "preempt_signal=SIGUSR1",
        "nccl_debug=info",
        "model=cnn",
        "--",
        "epochs=1",
        "--not-an-option",
    ]
    status, out, err = run(argv, capsys)

    assert status == 0, err
    expected = SbatchSpec(
        nodes=2,
        tasks_per_node=4,
        gpus_per_node=4,
        cpus_per_task=8,
        partition="gpu",
        account="proj42",
        qos="normal",
        time="2:00:00",
        launch_mode="torchrun",
        venv="/home/ada/venv",
        project_root=str(tmp_path),
        preempt_signal="USR1",
        requeue=True,
        nccl_debug="INFO",
        train_args=("model=cnn", "epochs=1", "--not-an-option"),
    )
    assert out == render_sbatch(expected)


def spec_of(*words):
    return slurm_cli.spec_from_config(parse(slurm_cli.SlurmConfig, words), [])


def test_environment_is_inferred_from_the_options(tmp_path):
    def spec(*argv):
        return spec_of(f"project_root={tmp_path}", *argv)

    assert spec("apptainer=/img.sif").env_mode == "apptainer"
    modules = spec("modules=python/3.11,cuda")
    assert (modules.env_mode, modules.modules, modules.venv) == ("modules", ("python/3.11", "cuda"), "")
    both = spec("modules=python/3.11", "venv=/v")
    assert (both.env_mode, both.venv) == ("venv", "/v")
    # Without any, the virtual environment running ddpkit (the test runs in one).
    assert sys.prefix != sys.base_prefix
    assert spec().venv == sys.prefix


def test_relative_paths_are_made_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    spec = spec_of("venv=venv", "stage_data=data")
    assert (spec.venv, spec.stage_data_from, spec.project_root) == (
        str(tmp_path / "venv"),
        str(tmp_path / "data"),
        str(tmp_path),
    )


def test_output_script_writes_an_executable_file(capsys, tmp_path):
    path = tmp_path / "job.sbatch"
    status, out, err = run(["venv=/v", "project_root=/p", f"output_script={path}", "epochs=1"], capsys)

    assert status == 0
    assert out == ""
    assert err == f"wrote {path}\n"
    assert path.read_text() == render_sbatch(SbatchSpec(venv="/v", project_root="/p", train_args=("epochs=1",)))
    assert os.access(path, os.X_OK)


def test_custom_command_is_split_like_a_shell(capsys):
    status, out, _ = run(["venv=/v", "command=python 'my train.py' --fast", "lr=0.1"], capsys)
    assert status == 0
    assert "python 'my train.py' --fast lr=0.1\n" in out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["venv=/v", "time=2h"], "error: time='2h' is not a Slurm time limit"),
        (["venv=/v", "nodes=0"], "error: nodes=0 must be an integer >= 1"),
        (["apptainer=/i.sif", "venv=/v", "env=apptainer"], "error: venv is not used"),
        (["venv=/v", "preempt_signal=KILL"], "error: preempt_signal='KILL' is not a signal"),
        (["launch=pdsh"], "error: launch='pdsh' is not valid; choose one of: srun, torchrun, mpirun"),
        (["venv=/v", "epochs=many"], "error: training option: bad value for 'epochs'"),
        (["venv=/v", "epoch=3"], "error: training option: unknown config key 'epoch' (did you mean 'epochs'?)"),
        (["--nodes", "2"], "error: ddpkit slurm takes key=value words: write --nodes 2 as nodes=2"),
        (
            ["--ntasks-per-node=4"],
            "error: ddpkit slurm takes key=value words: write --ntasks-per-node=4 as tasks_per_node=4",
        ),
        (["--submit"], "error: ddpkit slurm takes key=value words: write --submit as submit=true"),
        (["venv=/v", "max_restarts=2"], "error: max_restarts=2 needs launch=torchrun: srun and mpirun do not"),
    ],
)
def test_bad_options_end_in_one_line_and_status_2(argv, message, capsys):
    status = main(["slurm", *argv])
    out, err = capsys.readouterr()
    assert status == 2
    assert out == ""
    assert err.startswith(message) and err.count("\n") == 1


def test_max_restarts_goes_to_torchrun_not_to_its_workers(capsys):
    # A worker of torchrun restarts nothing: the word becomes torchrun's own option.
    status, out, _ = run(["venv=/v", "launch=torchrun", "max_restarts=2", "epochs=3"], capsys)
    assert status == 0
    assert "torchrun --nnodes=1 --nproc-per-node=1 --max-restarts=2 \\\n" in out
    assert "-m ddpkit train epochs=3\n" in out and "max_restarts=" not in out


def test_train_words_are_checked_only_for_ddpkit_train(capsys):
    # With command=, the words are the command's: ddpkit cannot know them.
    status, out, _ = run(["venv=/v", "command=python mine.py", "epoch=3"], capsys)
    assert status == 0
    assert "python mine.py epoch=3\n" in out


def test_node_local_paths_are_warned_about(capsys):
    status, out, err = run(["venv=/tmp/venv", "project_root=/tmp/work"], capsys)
    assert status == 0 and out
    assert err.splitlines() == [
        "warning: project_root (the job's --chdir) /tmp/work is node-local on most clusters: the other nodes (and "
        "this one, in a later job) may not see it; use a folder on shared storage",
        "warning: venv /tmp/venv is node-local on most clusters: the other nodes (and this one, in a later job) "
        "may not see it; use a folder on shared storage",
    ]
    _, _, err = run(["venv=/home/ada/venv", "project_root=/home/ada/work"], capsys)
    assert err == ""


def test_submit_without_sbatch_says_what_to_do(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty folder: no sbatch on the PATH
    status = main(["slurm", "venv=/v", f"project_root={tmp_path}", "submit=true"])
    out, err = capsys.readouterr()
    assert status == 2
    assert out == ""
    assert err.splitlines()[-1] == "error: sbatch not found: install Slurm's client or run without submit=true"


def test_ddpkit_cli_dispatches_to_slurm(capsys):
    assert main(["slurm", "venv=/v", "project_root=/p", "train.epochs=1"]) == 0
    assert capsys.readouterr().out == render_sbatch(SbatchSpec(venv="/v", project_root="/p", train_args=("epochs=1",)))
