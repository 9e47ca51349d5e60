"""The own-script examples run as documented, under ddpkit run, torchrun, srun and mpirun.

Each example is a plain PyTorch script made distributed with ddpkit; each
runs under ``ddpkit run`` and one other launcher (LAUNCHED_BY; srun and
mpirun in tests/cluster/test_examples.py) on 2 workers with tiny synthetic
data (the launcher is what is tested, not the workload's quality), prints its
epoch lines on rank 0 only, and leaves a checkpoint that a second run resumes from.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tests.cli_runner import PYTHONPATH, REPO
from tests.helpers.launch_in_process import Commands

pytestmark = pytest.mark.slow

EXAMPLES = {
    "mlp_fashion_mnist.py": "test accuracy",
    "cnn_mnist.py": "test accuracy",
    "autoencoder_fashion_mnist.py": "test mse",
}
TINY = ["--dataset", "synthetic", "--samples", "192", "--epochs", "2"]
LAUNCHED_BY = {"torchrun": "cnn_mnist.py", "mpirun": "autoencoder_fashion_mnist.py", "srun": "mlp_fashion_mnist.py"}
"""The example each other launcher starts. Every example runs under ``ddpkit run`` (as its docstring says)
and under one more launcher: the three call the same ddpkit functions (init, main_process_first,
prepare_model, DataLoader, Checkpointer, reduce_sums), so what a launcher changes (the environment
ddpkit.init reads) is shown by one of them, and each launch costs seconds."""


def _environ(**extra: str) -> dict[str, str]:
    launchers = ("MASTER_", "OMPI_", "PMIX_", "SLURM_", "TORCHELASTIC_", "RANK", "WORLD_SIZE", "LOCAL_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(launchers)}
    return {**env, "PYTHONPATH": PYTHONPATH, **extra}


def _check(out: subprocess.CompletedProcess, example: str) -> None:
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [line for line in out.stdout.splitlines() if line.startswith("epoch")]
    assert [line.split(":")[0] for line in lines] == ["epoch 1", "epoch 2"], out.stdout  # rank 0 only
    assert all(EXAMPLES[example] in line for line in lines), out.stdout


def _script(example: str) -> str:
    return str(REPO / "examples" / example)


@pytest.fixture(scope="module")
def under_ddpkit_run(tmp_path_factory) -> dict:
    """Every ``ddpkit run nproc=2`` of this module, by name: its folder and result.

    The commands run in this process (``ddpkit.commands.dispatch.main``) with the variables of outer launchers hidden,
    their workers forked from one worker server shared by all of them; the ``ddpkit`` command's own
    process is started by tests/launchers/test_run.py and others.
    """
    from tests.horovod.ddp_reference import SCRIPT, TINY as HOROVOD_TINY

    runs = {}
    with Commands() as commands:
        for example in sorted(EXAMPLES):
            folder = tmp_path_factory.mktemp(example.removesuffix(".py"))
            words = ["run", "nproc=2", _script(example), *TINY, "--out", str(folder)]
            runs[example] = (folder, commands.run(*words, cwd=folder, clean_environment=True))
            if example == "mlp_fashion_mnist.py":  # (one example is enough to show the re-run)
                runs["again"] = (folder, commands.run(*words, cwd=folder, clean_environment=True))
        folder = tmp_path_factory.mktemp("horovod")
        words = ["run", "nproc=2", str(SCRIPT), *HOROVOD_TINY, "--save-weights", str(folder / "weights.pt")]
        runs["horovod"] = (folder, commands.run(*words, cwd=folder, clean_environment=True))
    return runs


@pytest.mark.parametrize("example", sorted(EXAMPLES))
def test_example_under_ddpkit_run_then_resumes(example, under_ddpkit_run):
    _check(under_ddpkit_run[example][1], example)
    if example != "mlp_fashion_mnist.py":
        return  # (one example is enough to show the re-run; each launch costs seconds)
    # The same command again: the run is complete, so it resumes at the end and trains nothing more.
    again = under_ddpkit_run["again"][1]
    assert again.returncode == 0, again.stderr[-3000:]
    assert not [line for line in again.stdout.splitlines() if line.startswith("epoch")], again.stdout


def test_every_example_runs_under_two_launchers():
    assert sorted(LAUNCHED_BY.values()) == sorted(EXAMPLES)  # and all of them under ddpkit run


@pytest.mark.parametrize("example", [LAUNCHED_BY["torchrun"]])
def test_example_under_torchrun(example, tmp_path):
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        _script(example),
        *TINY,
        "--out",
        str(tmp_path),
    ]
    _check(subprocess.run(command, cwd=tmp_path, env=_environ(), capture_output=True, text=True, timeout=300), example)


def test_horovod_example_under_ddpkit_run_ends_with_stock_ddp_weights(under_ddpkit_run):
    from tests.horovod.ddp_reference import assert_same_weights, ddp_weights

    folder, out = under_ddpkit_run["horovod"]
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [line for line in out.stdout.splitlines() if line.startswith("epoch")]
    assert [line.split(":")[0] for line in lines] == ["epoch 1", "epoch 2"], out.stdout  # rank 0 only
    assert_same_weights(torch.load(folder / "weights.pt"), ddp_weights())
