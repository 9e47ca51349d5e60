"""The Horovod example under real OpenMPI mpirun, as Horovod's jobscripts launch it, against stock DDP."""

from __future__ import annotations

import sys

import pytest
import torch

from tests.helpers.mpi import run_mpirun
from tests.horovod.ddp_reference import SCRIPT, TINY, assert_same_weights, ddp_weights
from tests.test_examples import _environ

pytestmark = [pytest.mark.cluster, pytest.mark.slow]


def test_horovod_example_under_mpirun_ends_with_stock_ddp_weights(tmp_path):
    weights = tmp_path / "weights.pt"
    out = run_mpirun(
        2, [sys.executable, str(SCRIPT), *TINY, "--save-weights", str(weights)], env=_environ(), timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [line for line in out.stdout.splitlines() if line.startswith("epoch")]
    assert [line.split(":")[0] for line in lines] == ["epoch 1", "epoch 2"], out.stdout  # rank 0 only
    assert_same_weights(torch.load(weights), ddp_weights())
