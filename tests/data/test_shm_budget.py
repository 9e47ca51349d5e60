"""A DataLoader's workers in a small /dev/shm: a warning before they start, one line instead of torch's traceback."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from ddpkit.data.shm_budget import sample_bytes
from ddpkit.env.shared_memory import FIX
from tests.cli_runner import PYTHONPATH
from tests.helpers.small_shm import with_shm_of

MIB = 1 << 20


def test_sample_bytes_counts_tensors_arrays_and_numbers():
    sample = {"image": torch.zeros(3, 4), "mask": np.zeros(5, dtype=np.uint8), "label": 3, "name": "a.png"}
    assert sample_bytes(sample) == 3 * 4 * 4 + 5 + 8
    assert sample_bytes((torch.zeros(2, dtype=torch.float64), [1.0, 2.0])) == 16 + 16


# Samples of 1 MiB, batches of 4 per rank, 2 workers prefetching 2 each: about 24 MiB, in an 8 MiB /dev/shm.
# Batches of 1 need about 6 MiB: they fit.
_LOOPS = """
import sys
import torch
from torch.utils.data import Dataset
import ddpkit
from ddpkit.env.shared_memory import SharedMemoryError

class OneMiB(Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, index):
        return torch.full((256, 1024), float(index)), index

def first_batches(global_batch_size):
    loader = ddpkit.DataLoader(OneMiB(), global_batch_size=global_batch_size, num_workers=2)
    return [int(batch[1][0]) for _, batch in zip(range(3), loader)]

print("batch of 1:", first_batches(1), file=sys.stderr, flush=True)
try:
    first_batches(4)
except SharedMemoryError as e:
    print(f"SharedMemoryError: {e}", file=sys.stderr)
"""


@pytest.mark.cluster
@pytest.mark.slow
def test_workers_out_of_shared_memory_warn_first_then_fail_in_one_line():
    argv = with_shm_of(8 * MIB, [sys.executable, "-c", _LOOPS])
    out = subprocess.run(
        argv, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": PYTHONPATH}, timeout=240
    )
    lines = out.stderr.splitlines()
    assert out.returncode == 0 and len(lines) == 3, out.stderr[-4000:]
    assert lines[0].startswith("batch of 1: [")  # (no warning: 6 MiB fit)
    assert lines[1] == (
        "a DataLoader with 2 worker processes (4 batches ahead) in each of 1 training processes of this node needs "
        f"about 24.0 MiB of shared memory but /dev/shm has 8.0 MiB free of 8.0 MiB; {FIX}; "
        "or lower num_workers or prefetch_factor"
    )
    assert lines[2].startswith(
        "SharedMemoryError: a DataLoader worker ran out of shared memory: a DataLoader with 2 worker processes "
        "(4 batches ahead) in each of 1 training processes of this node needs about 24.0 MiB of shared memory but "
        "/dev/shm has "
    ), lines[2]
    assert lines[2].endswith(f"free of 8.0 MiB; {FIX}")
