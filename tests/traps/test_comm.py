"""Scripts ported from pytorch/examples train right under ``ddpkit run nproc=2``: gradients, buffers, seeds, sums.

Each test runs a small real script (``tests/traps/scripts/comm_*.py``) on two
workers and checks what its user would: equal weights on every rank, the
same BatchNorm statistics as DDP, one line naming the fix, sums of the right
shape.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers.launch_in_process import Commands
from tests.helpers.local_nodes import run_two_local_nodes

SCRIPTS = Path(__file__).resolve().parent / "scripts"


def test_two_ddp_models_with_the_shared_memory_hook_train_200_steps(tmp_path):
    # DCGAN's netG and netD, both on DDP with the shared-memory all_reduce as the hook: before, the two
    # models' hook threads reduced at once and the ranks met with buckets of different sizes.
    with Commands() as commands:
        done = commands.run("run", "nproc=2", str(SCRIPTS / "comm_gan.py"), "200", "shm", "gan.pt", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "trained 200 steps, weights equal on every rank" in done.stdout


@pytest.mark.timeout(240)
def test_two_ddp_models_with_the_ring_hook_train_200_steps_on_two_nodes(tmp_path):
    # `ddpkit run nnodes=2` twice on this machine, one worker each: the ring's send/recv of two models'
    # buckets crossed (gloo's "Connection reset by peer", an abort or a hang) before.
    done = run_two_local_nodes(SCRIPTS / "comm_gan.py", "200", "ring", "gan.pt", cwd=tmp_path, timeout=200)
    assert [node.returncode for node in done] == [0, 0], done[0].stderr[-3000:] + done[1].stderr[-3000:]
    assert "trained 200 steps, weights equal on every rank" in done[0].stdout
    assert set(torch.load(tmp_path / "gan.pt")) == {"G", "D"}


def test_flat_gradients_keep_batchnorm_statistics_as_ddp_does(tmp_path):
    # Before, grad_sync=flat never broadcast buffers: each rank's running statistics were its own data's.
    with Commands() as commands:
        for mode in ("flat", "ddp"):
            done = commands.run("run", "nproc=2", str(SCRIPTS / "comm_batchnorm.py"), mode, mode, cwd=tmp_path)
            assert done.returncode == 0, done.stderr[-3000:]
    for rank in (0, 1):
        flat, ddp = (torch.load(tmp_path / f"{mode}-{rank}.pt") for mode in ("flat", "ddp"))
        assert list(flat) == list(ddp)
        for name in flat:
            # The two modes average with different roundings (DDP divides before the sum), hence allclose.
            assert torch.allclose(flat[name], ddp[name], rtol=1e-4, atol=1e-5), (rank, name)


def test_reduce_sums_adds_a_confusion_matrix_and_keeps_its_shape(tmp_path):
    # Before: "RuntimeError: shape '[]' is invalid for input of size 100".
    with Commands() as commands:
        done = commands.run("run", "nproc=2", str(SCRIPTS / "comm_confusion.py"), cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    # Ranks 0 and 1 each count 5 samples; the diagonal: rank 0's i=0, rank 1's i=0.
    assert "confusion (10, 10) torch.int64 sum=10 trace=2" in done.stdout
    assert "loss=1.5 count=10.0" in done.stdout


def test_a_seed_drawn_per_rank_is_refused_in_one_line_and_a_shared_one_sees_every_sample(tmp_path):
    # Before: each rank shuffled its own permutation; an epoch trained 16 samples of which about 12 distinct.
    with Commands() as commands:
        drawn = commands.run("run", "nproc=2", str(SCRIPTS / "comm_seed.py"), cwd=tmp_path)
        shared = commands.run("run", "nproc=2", str(SCRIPTS / "comm_seed.py"), "7", cwd=tmp_path)
    assert drawn.returncode != 0
    lines = [line for line in drawn.stderr.splitlines() if "the ranks disagree on seed" in line]
    assert lines and all("pass the same seed on every rank" in line for line in lines), drawn.stderr[-3000:]
    assert "Traceback" not in drawn.stderr, drawn.stderr[-3000:]
    assert shared.returncode == 0, shared.stderr[-3000:]
    assert "epoch saw 16 samples, 16 distinct" in shared.stdout


def test_saving_a_sharded_models_state_dict_with_torch_save_is_refused_in_one_line(tmp_path):
    # Before: rank 0 wrote its own shards as DTensors (a file that loads nowhere else), silently.
    with Commands() as commands:
        naive = commands.run("run", "nproc=2", str(SCRIPTS / "comm_shard_save.py"), "naive", "m.pt", cwd=tmp_path)
        full = commands.run("run", "nproc=2", str(SCRIPTS / "comm_shard_save.py"), "full", "f.pt", cwd=tmp_path)
    assert naive.returncode != 0
    assert "Traceback" not in naive.stderr, naive.stderr[-3000:]
    lines = [line for line in naive.stderr.splitlines() if "holds only this rank's shards" in line]
    assert len(lines) == 1 and "ddpkit export" in lines[0] and "full_state_dict=True" in lines[0], naive.stderr
    assert full.returncode == 0, full.stderr[-3000:]
    assert "saved 1.weight (10, 784), 1.bias (10,)" in full.stdout
    assert torch.load(tmp_path / "f.pt")["1.weight"].shape == (10, 784)  # plain tensors, here without a group
