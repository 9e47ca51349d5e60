"""On CUDA: ``ddpkit train`` (W1, W2, W3, SyncBatchNorm; one and two workers), the examples and the tutorial's Trainer.

The examples and the Trainer class have no ``.to`` call: the batches arrive on the GPU.

Two workers take two GPUs over nccl; with a single GPU they share it over
gloo (tests/gpu/runs.py).
"""

from __future__ import annotations

import ast
import math
import subprocess
import sys

import pytest

from tests.cli_runner import REPO
from tests.gpu.runs import TIMEOUT, environ, train, two_workers_share_one_gpu
from tests.test_examples import EXAMPLES  # each example and the words of its epoch lines

WORKLOADS = {"mlp": "accuracy", "cnn": "accuracy", "autoencoder": "mse"}


def _backend(nproc: int) -> str:
    return "gloo" if nproc == 2 and two_workers_share_one_gpu() else "nccl"


@pytest.mark.parametrize("nproc", [1, 2])
@pytest.mark.parametrize("model", sorted(WORKLOADS))
def test_reference_workloads_train_on_cuda(tmp_path, model, nproc):
    summary, text = train(tmp_path / "run", f"model={model}", nproc=nproc)
    assert summary["world_size"] == nproc and summary["global_steps"] > 0
    assert summary["config"]["device"] == "cuda"
    assert f"backend {_backend(nproc)}, device cuda:0" in text, text[-3000:]
    assert math.isfinite(summary["test"][WORKLOADS[model]])
    assert summary["allreduce"] == "builtin"  # allreduce=auto never picks shared memory for CUDA tensors


@pytest.mark.parametrize("nproc", [1, 2])
def test_sync_batchnorm_trains_cnn_bn_on_cuda(tmp_path, nproc):
    summary, _ = train(tmp_path / "run", "model=cnn_bn", "sync_batchnorm=true", nproc=nproc)
    assert summary["world_size"] == nproc and summary["grad_sync"] == ("ddp" if nproc > 1 else "none")
    assert math.isfinite(summary["test"]["accuracy"])


def _to_calls(script) -> list[int]:
    """The lines of ``script`` that call a ``.to(...)`` method."""
    calls = ast.walk(ast.parse(script.read_text()))
    return [c.lineno for c in calls if isinstance(c, ast.Call) and getattr(c.func, "attr", None) == "to"]


def _ddpkit_run(tmp_path, script, *args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "ddpkit", "run", "nproc=1", str(script), *args]
    out = subprocess.run(command, cwd=tmp_path, env=environ(), capture_output=True, text=True, timeout=TIMEOUT)
    assert out.returncode == 0, (out.stdout + out.stderr)[-5000:]
    return out


@pytest.mark.parametrize("example", sorted(EXAMPLES))
def test_own_loop_examples_on_cuda_without_to_device(tmp_path, example):
    """examples/*.py under ``ddpkit run nproc=1``: no ``.to`` in them; ddpkit.init() binds the GPU (device auto)."""
    script = REPO / "examples" / example
    assert not _to_calls(script)
    out = _ddpkit_run(tmp_path, script, "--dataset", "synthetic", "--samples", "512", "--epochs", "2", "--out", "out")
    lines = [line for line in out.stdout.splitlines() if line.startswith("epoch")]
    assert [line.split(":")[0] for line in lines] == ["epoch 1", "epoch 2"], out.stdout
    assert all(EXAMPLES[example] in line for line in lines), out.stdout


def test_the_tutorials_trainer_class_without_to_runs_on_cuda_and_resumes(tmp_path):
    """The DDP tutorial's Trainer (multigpu_torchrun.py) ported as the README says: batches arrive on cuda:0."""
    script = REPO / "tests" / "gpu" / "scripts" / "multigpu_trainer.py"
    assert not _to_calls(script)
    out = _ddpkit_run(tmp_path, script, "--epochs", "2", "--out", "snapshots")
    lines = [line for line in out.stdout.splitlines() if line.startswith("epoch")]
    assert [line.split(":")[0] for line in lines] == ["epoch 0", "epoch 1"], out.stdout
    assert all("batches on cuda:0," in line for line in lines), out.stdout
    out = _ddpkit_run(tmp_path, script, "--epochs", "3", "--out", "snapshots")
    lines = [line for line in out.stdout.splitlines() if line.startswith("epoch")]
    assert [line.split(":")[0] for line in lines] == ["epoch 2"], out.stdout + out.stderr
