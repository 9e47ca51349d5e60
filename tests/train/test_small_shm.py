"""`ddpkit train` in a /dev/shm too small for the shared-memory all_reduce: auto falls back, shm is refused."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from ddpkit.env.shared_memory import FIX
from tests.cli_runner import PYTHONPATH
from tests.helpers.small_shm import with_shm_of

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

TINY = ("dataset=synthetic", "synthetic_samples=512", "epochs=1", "progress=false")
ONE_MIB = 1 << 20  # what the segment of 2 workers (4 MiB) does not fit in


def train_in_small_shm(tmp_path, *words: str) -> subprocess.CompletedProcess:
    argv = with_shm_of(ONE_MIB, [sys.executable, "-m", "ddpkit", "train", "nproc=2", *TINY, *words])
    return subprocess.run(
        argv, cwd=tmp_path, capture_output=True, text=True, timeout=240, env={**os.environ, "PYTHONPATH": PYTHONPATH}
    )


def test_allreduce_auto_falls_back_to_gloo_with_one_line_naming_the_fix(tmp_path):
    out = train_in_small_shm(tmp_path)

    assert out.returncode == 0, out.stderr[-3000:]
    warnings = [line for line in out.stderr.splitlines() if "allreduce=auto:" in line]
    assert warnings == [
        "[rank 0/2] allreduce=auto: using gloo's all_reduce (builtin), not shm: the shared-memory all_reduce of 2 "
        f"workers needs about 4.0 MiB of shared memory but /dev/shm has 1.0 MiB free of 1.0 MiB; {FIX}"
    ], out.stderr[-3000:]
    assert "gradients: flat of 155 KiB with all_reduce=builtin over gloo" in out.stderr
    assert "[rank 0/2] done: mlp on synthetic, 2 worker(s)" in out.stderr


def test_allreduce_shm_is_refused_before_any_worker_starts(tmp_path):
    out = train_in_small_shm(tmp_path, "allreduce=shm")

    assert out.returncode == 2
    assert out.stderr == (
        "error: allreduce=shm with nproc=2 needs about 4.0 MiB of shared memory but /dev/shm has 1.0 MiB free of "
        f"1.0 MiB; {FIX}; or allreduce=auto\n"
    )
