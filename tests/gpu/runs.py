"""Running ``ddpkit train`` on GPUs as a user would, and reading what it wrote.

Two workers need two GPUs for nccl, which refuses two ranks on one GPU. On a
machine with a single GPU, :func:`train` starts the two workers the way a job
of two one-GPU nodes starts them (torch's env:// variables, each worker local
rank 0 of its own "node", both bound to GPU 0) with ``backend=gloo``, which
takes CUDA tensors.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from ddpkit.checkpoint.disk.format import load_file
from ddpkit.env.ports import free_port
from tests.cli_runner import PYTHONPATH

TIMEOUT = 600
LAUNCHER_VARIABLES = ("MASTER_", "OMPI_", "PMIX_", "SLURM_", "TORCHELASTIC_", "RANK", "WORLD_SIZE", "LOCAL_", "GROUP_")

TINY = ("dataset=synthetic", "synthetic_samples=512", "epochs=1", "progress=false", "timeout=120")
"""Small runs: synthetic data (no download on the GPU machine), a few dozen steps."""


def environ(**extra: str) -> dict[str, str]:
    """This process's environment without any launcher's variables, with the repository importable."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(LAUNCHER_VARIABLES)}
    # cuBLAS picks deterministic kernels with a fixed workspace: resumed runs compare bit for bit.
    return {**env, "PYTHONPATH": PYTHONPATH, "CUBLAS_WORKSPACE_CONFIG": ":4096:8", **extra}


def two_workers_share_one_gpu() -> bool:
    """True where two workers must share GPU 0 (over gloo) because there is a single GPU."""
    return torch.cuda.device_count() < 2


def train(output_dir: Path, *words: str, nproc: int = 1) -> tuple[dict[str, Any], str]:
    """Run ``ddpkit train device=cuda WORDS`` with ``nproc`` workers; return rank 0's summary and the output.

    Raises:
        AssertionError: a worker failed (the message holds its output).
    """
    words = ("device=cuda", *TINY, f"output_dir={output_dir}", *words)
    command = [sys.executable, "-m", "ddpkit", "train", *words]
    if nproc == 1 or not two_workers_share_one_gpu():
        out = subprocess.run(
            [*command, f"nproc={nproc}"],
            cwd=output_dir.parent,
            env=environ(),
            capture_output=True,
            text=True,
            timeout=TIMEOUT,
        )
        text = out.stdout + out.stderr
        assert out.returncode == 0, text[-5000:]
    else:
        assert nproc == 2, "one GPU is shared by two workers at most here"
        text = _train_sharing_gpu_0(command, output_dir.parent)
    return json.loads((output_dir / "summary.json").read_text()), text


def _train_sharing_gpu_0(command: list[str], cwd: Path) -> str:
    port = str(free_port())
    procs = []
    for rank in range(2):
        env = environ(
            RANK=str(rank),
            WORLD_SIZE="2",
            LOCAL_RANK="0",
            LOCAL_WORLD_SIZE="1",
            GROUP_RANK=str(rank),
            GROUP_WORLD_SIZE="2",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=port,
        )
        procs.append(
            subprocess.Popen(
                [*command, "backend=gloo"],
                cwd=cwd,
                env=env,
                text=True,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
            )
        )
    texts = []
    try:
        for proc in procs:
            texts.append(proc.communicate(timeout=TIMEOUT)[0])
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for rank, (proc, text) in enumerate(zip(procs, texts)):
        assert proc.returncode == 0, f"rank {rank} (sharing GPU 0 over gloo) exited {proc.returncode}:\n{text[-5000:]}"
    return "\n".join(texts)


def newest_checkpoint(output_dir: Path) -> Path:
    """The newest ``step-*`` checkpoint folder of a run."""
    folders = sorted((output_dir / "checkpoints").glob("step-*"))
    assert folders, f"no checkpoint in {output_dir / 'checkpoints'}"
    return folders[-1]


def weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    """The model weights of a checkpoint, loaded onto the CPU."""
    return load_file(checkpoint / "model.pt", map_location="cpu")
