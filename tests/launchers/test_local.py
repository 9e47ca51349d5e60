"""Local launch through torch's elastic agent: one report per failure, never a hang."""

import socket

import pytest

from ddpkit.commands.dispatch import main
from tests.cli_runner import run_ddpkit
from tests.helpers.launch_in_process import Commands
from tests.helpers.workloads import W1_ACCURACY_FLOOR

SMALL = ["dataset=synthetic", "synthetic_samples=256", "epochs=1", "progress=false"]


@pytest.fixture(scope="module")
def failed(tmp_path_factory) -> dict:
    """``ddpkit train nproc=2`` with a model that fails on rank 1, by how it fails: each command's result.

    The commands run in this process (``ddpkit.commands.dispatch.main``), their workers forked from one worker server
    shared by both; the command's own exit path is checked by tests/test_cli.py.
    """
    folder = tmp_path_factory.mktemp("failed")
    with Commands() as commands:
        return {
            "raises": commands.run(
                "train", "nproc=2", "model=tests.launchers.failing_model:fails_on_rank_one", *SMALL, cwd=folder
            ),
            "killed": commands.run(
                "train",
                "nproc=2",
                "model=tests.launchers.failing_model:killed_on_rank_one",
                *SMALL,
                "timeout=30",
                cwd=folder,
            ),
        }


def test_failing_rank_reported_once(failed):
    out = failed["raises"]
    assert out.returncode == 1
    error_lines = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert error_lines == [
        "error: worker rank 1 failed (exit code 1): RuntimeError: model construction failed on purpose"
    ], out.stderr
    assert out.stderr.count("Traceback (most recent call last)") == 1, out.stderr
    assert "fails_on_rank_one" in out.stderr


def test_killed_rank_reported_with_signal(failed):
    out = failed["killed"]
    assert out.returncode == 1
    assert "error: worker rank 1 failed (exit code -9): Signal 9 (SIGKILL) received by PID" in out.stderr, out.stderr


def test_port_taken_is_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        # In-process (refused before any worker starts); tests/test_cli.py checks the command's exit path.
        assert main(["train", "nproc=2", f"master_port={port}", *SMALL]) == 2
    err = capsys.readouterr().err
    assert err == f"error: master_port={port} is already in use on 127.0.0.1; choose another port or master_port=0\n"


@pytest.mark.slow
def test_w1_two_workers_real_fashion_mnist(tmp_path, fashion_mnist):
    """The README's main job: W1 on real Fashion-MNIST with 2 workers trains to its quality floor."""
    out = run_ddpkit("train", "nproc=2", "progress=false", cwd=tmp_path, timeout=600)
    assert out.returncode == 0, out.stderr
    import json

    summary = json.loads((tmp_path / "runs" / "latest" / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["dataset"] == "fashion-mnist" and summary["epochs"] == 5
    assert summary["test"]["accuracy"] >= W1_ACCURACY_FLOOR
    assert "test accuracy" in out.stderr and "train time" in out.stderr
