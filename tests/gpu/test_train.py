"""``ddpkit train`` and an own-loop script on CUDA: W1, W2, W3 and SyncBatchNorm, one and two workers.

Two workers take two GPUs over nccl; with a single GPU they share it over
gloo (tests/gpu/runs.py).
"""

from __future__ import annotations

import math
import subprocess
import sys

import pytest

from tests.cli_runner import REPO
from tests.gpu.runs import TIMEOUT, environ, train, two_workers_share_one_gpu

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


def test_own_loop_example_on_cuda(tmp_path):
    """examples/mlp_fashion_mnist.py under ``ddpkit run nproc=1``: ddpkit.init() binds the GPU (device auto)."""
    command = [
        sys.executable,
        "-m",
        "ddpkit",
        "run",
        "nproc=1",
        str(REPO / "examples" / "mlp_fashion_mnist.py"),
        "--dataset",
        "synthetic",
        "--samples",
        "512",
        "--epochs",
        "2",
        "--out",
        str(tmp_path / "out"),
    ]
    out = subprocess.run(command, cwd=tmp_path, env=environ(), capture_output=True, text=True, timeout=TIMEOUT)
    assert out.returncode == 0, (out.stdout + out.stderr)[-5000:]
    lines = [line for line in out.stdout.splitlines() if line.startswith("epoch")]
    assert [line.split(":")[0] for line in lines] == ["epoch 1", "epoch 2"], out.stdout
    assert all("test accuracy" in line for line in lines), out.stdout
