"""``ddpkit slurm`` options: the script it prints or writes, and its errors.

Submitting for real is tested against a Slurm cluster in tests/cluster.
"""

from __future__ import annotations

import os
import sys

import pytest

from ddpkit.launch import slurm_cli
from ddpkit.launch.sbatch import SbatchSpec, render_sbatch


def run(argv, capsys):
    status = slurm_cli.main(argv)
    out, err = capsys.readouterr()
    return status, out, err


def test_prints_the_script_of_the_options(capsys, tmp_path):
    argv = [
        "--nodes", "2", "--tasks-per-node", "4", "--gpus-per-node", "4", "--cpus-per-task", "8",
        "--partition", "gpu", "--account", "proj42", "--qos", "normal", "--time", "2:00:00",
        "--launch", "torchrun", "--venv", "/home/ada/venv", "--project-root", str(tmp_path),
        "--preempt-signal", "SIGUSR1", "--nccl-debug", "info", "model=cnn", "--", "epochs=1", "--not-an-option",
    ]
    status, out, err = run(argv, capsys)

    assert status == 0, err
    expected = SbatchSpec(
        nodes=2, tasks_per_node=4, gpus_per_node=4, cpus_per_task=8, partition="gpu", account="proj42",
        qos="normal", time="2:00:00", launch_mode="torchrun", venv="/home/ada/venv", project_root=str(tmp_path),
        preempt_signal="USR1", requeue=True, nccl_debug="INFO", train_args=("model=cnn", "epochs=1", "--not-an-option"),
    )
    assert out == render_sbatch(expected)


def test_environment_is_inferred_from_the_options(tmp_path):
    parser = slurm_cli.build_parser()

    def spec(*argv):
        return slurm_cli.spec_from_args(parser.parse_intermixed_args(["--project-root", str(tmp_path), *argv]), [])

    assert spec("--apptainer", "/img.sif").env_mode == "apptainer"
    modules = spec("--module", "python/3.11", "--module", "cuda")
    assert (modules.env_mode, modules.modules, modules.venv) == ("modules", ("python/3.11", "cuda"), "")
    both = spec("--module", "python/3.11", "--venv", "/v")
    assert (both.env_mode, both.venv) == ("venv", "/v")
    # Without any, the virtual environment running ddpkit (the test runs in one).
    assert sys.prefix != sys.base_prefix
    assert spec().venv == sys.prefix


def test_relative_paths_are_made_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    parser = slurm_cli.build_parser()
    args = parser.parse_intermixed_args(["--venv", "venv", "--stage-data", "data"])
    spec = slurm_cli.spec_from_args(args, [])
    assert (spec.venv, spec.stage_data_from, spec.project_root) == (
        str(tmp_path / "venv"), str(tmp_path / "data"), str(tmp_path)
    )


def test_output_script_writes_an_executable_file(capsys, tmp_path):
    path = tmp_path / "job.sbatch"
    status, out, err = run(["--venv", "/v", "--project-root", "/p", "--output-script", str(path), "epochs=1"], capsys)

    assert status == 0
    assert out == ""
    assert err == f"wrote {path}\n"
    assert path.read_text() == render_sbatch(SbatchSpec(venv="/v", project_root="/p", train_args=("epochs=1",)))
    assert os.access(path, os.X_OK)


def test_custom_command_is_split_like_a_shell(capsys):
    status, out, _ = run(["--venv", "/v", "--command", "python 'my train.py' --fast", "lr=0.1"], capsys)
    assert status == 0
    assert "python 'my train.py' --fast lr=0.1\n" in out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--venv", "/v", "--time", "2h"], "ddpkit slurm: error: time='2h' is not a Slurm time limit"),
        (["--venv", "/v", "--nodes", "0"], "ddpkit slurm: error: nodes=0 must be an integer >= 1"),
        (["--apptainer", "/i.sif", "--venv", "/v", "--env", "apptainer"], "ddpkit slurm: error: venv is not used"),
        (["--venv", "/v", "--preempt-signal", "KILL"], "ddpkit slurm: error: preempt_signal='KILL' is not a signal"),
    ],
)
def test_bad_options_end_in_one_line_and_status_2(argv, message, capsys):
    status, out, err = run(argv, capsys)
    assert status == 2
    assert out == ""
    assert err.startswith(message) and err.count("\n") == 1


def test_unknown_launch_mode_lists_the_valid_ones(capsys):
    status, _, err = run(["--launch", "pdsh"], capsys)
    assert status == 2
    assert "invalid choice: 'pdsh' (choose from 'srun', 'torchrun', 'mpirun')" in err


def test_submit_without_sbatch_says_what_to_do(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty folder: no sbatch on the PATH
    status, out, err = run(["--venv", "/v", "--project-root", str(tmp_path), "--submit"], capsys)
    assert status == 2
    assert out == ""
    assert err == "ddpkit slurm: error: sbatch not found: install Slurm's client or run without --submit\n"


def test_ddpkit_cli_dispatches_to_slurm(capsys):
    from ddpkit.cli import main

    assert main(["slurm", "--venv", "/v", "--project-root", "/p", "epochs=1"]) == 0
    assert capsys.readouterr().out == render_sbatch(SbatchSpec(venv="/v", project_root="/p", train_args=("epochs=1",)))
