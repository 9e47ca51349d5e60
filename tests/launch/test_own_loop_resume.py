"""A user's own training loop (scripts/own_cnn.py) interrupted under ``ddpkit run`` ends bit-identical.

The script trains a small CNN with dropout on randomly augmented images,
``ddpkit.DataLoader(num_workers=2)``, SGD with momentum and StepLR, and a
``ddpkit.Checkpointer`` resumed with ``resume("auto")``. Its final weights
after an interruption are compared with ``torch.equal`` to those of one
uninterrupted ``ddpkit run nproc=2``: model, optimizer, scheduler, every
rank's RNG (dropout) and the loader's position must all be restored exactly.
Where the interruption falls is drawn from ``random.Random(SEED)`` and printed.
"""

from __future__ import annotations

import random
import re
from pathlib import Path

import pytest
import torch

from ddpkit.checkpoint.format import list_checkpoints, read_manifest
from tests.cli_runner import run_ddpkit

SCRIPT = Path(__file__).resolve().parent / "scripts" / "own_cnn.py"
SEED = 4242
"""Seed of the interruption points."""
STEPS = 26
"""Global steps of the script's 2 epochs: 13 global batches of 16 (the last of 8) each."""
TIMEOUT = 300


def _run(folder: Path, *options: str, every_steps: int, num_workers: int = 2, env: dict[str, str] | None = None):
    return run_ddpkit("run", *options, str(SCRIPT), "--out", str(folder / "ckpt"), "--final", str(folder / "final.pt"),
                      "--every-steps", str(every_steps), "--num-workers", str(num_workers), cwd=folder,
                      timeout=TIMEOUT, env=env)


def _starts(stdout: str) -> list[tuple[str, int, bool]]:
    """(rank, global step, resumed) of every start line the script printed, by rank."""
    found = re.findall(r"rank (\d): start epoch=\d+ step_in_epoch=\d+ global_step=(\d+) resumed=(True|False)", stdout)
    return sorted((rank, int(step), resumed == "True") for rank, step, resumed in found)


def _assert_bit_equal(path: Path, reference: dict[str, torch.Tensor]) -> None:
    weights = torch.load(path, weights_only=True)
    assert weights.keys() == reference.keys()
    differing = [name for name in reference if not torch.equal(weights[name], reference[name])]
    assert not differing, f"final weights differ from the uninterrupted run's in {differing}"


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[str, torch.Tensor]:
    """Final weights of one uninterrupted ``ddpkit run nproc=2`` (checkpoints at epoch ends only).

    It loads data in the training processes (num_workers=0) and the runs under test with 2 DataLoader
    workers each: equal weights also show that the loader's workers change nothing (per-sample seeding).
    """
    folder = tmp_path_factory.mktemp("reference")
    out = _run(folder, "nproc=2", every_steps=0, num_workers=0)
    assert out.returncode == 0, out.stdout + out.stderr
    assert _starts(out.stdout) == [("0", 0, False), ("1", 0, False)]
    return torch.load(folder / "final.pt", weights_only=True)


def test_a_killed_rank_is_restarted_and_the_run_ends_bit_identical(tmp_path, reference):
    rng = random.Random(SEED)
    kill_at, kill_rank = rng.randint(3, STEPS - 2), rng.randint(0, 1)
    print(f"seed {SEED}: SIGKILL to rank {kill_rank} after optimizer step {kill_at}")
    env = {"KILL_AT_STEP": str(kill_at), "KILL_RANK": str(kill_rank)}
    out = _run(tmp_path, "nproc=2", "max_restarts=1", every_steps=2, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"rank {kill_rank}: sending myself SIGKILL after step {kill_at}" in out.stdout
    # Killed before ckpt.step() counted step kill_at: the newest checkpoint is the one before it
    # (every 2 steps, and at the end of epoch 1 after step 13); step kill_at is computed again.
    saved = max(2 * ((kill_at - 1) // 2), 13 if kill_at > 13 else 0)
    assert _starts(out.stdout) == [("0", 0, False), ("0", saved, True), ("1", 0, False), ("1", saved, True)]
    _assert_bit_equal(tmp_path / "final.pt", reference)


def test_sigterm_checkpoints_exits_75_and_the_same_command_completes_bit_identical(tmp_path, reference):
    rng = random.Random(SEED + 1)
    signal_at, signal_rank = rng.randint(2, STEPS - 6), rng.randint(0, 1)
    print(f"seed {SEED + 1}: SIGTERM to rank {signal_rank} after optimizer step {signal_at}")
    env = {"KILL_AT_STEP": str(signal_at), "KILL_RANK": str(signal_rank), "SIGNAL": "SIGTERM"}

    # No checkpoint cadence: the one mid-epoch checkpoint is the preemption's own.
    first = _run(tmp_path, "nproc=2", every_steps=0, env=env)
    assert first.returncode == 75, first.stdout + first.stderr
    assert "ddpkit: preempted: a worker exited with status 75; run the same command to continue" \
        in first.stderr
    stop = re.search(r"preempted by SIGTERM after global step (\d+): checkpoint (\S+) is complete", first.stderr)
    assert stop is not None, first.stderr
    step = int(stop[1])
    # The ranks agree on the signal a few steps later at most (sync_seconds=0.005 in the script).
    assert signal_at <= step < STEPS
    newest = [info for info in list_checkpoints(tmp_path / "ckpt") if info.complete][-1]
    assert (newest.global_step, str(newest.path)) == (step, stop[2])
    assert read_manifest(newest.path)["reason"] == "preempted"
    assert not (tmp_path / "final.pt").exists()

    again = _run(tmp_path, "nproc=2", every_steps=0, env=env)  # the same command
    assert again.returncode == 0, again.stdout + again.stderr
    assert _starts(again.stdout) == [("0", step, True), ("1", step, True)]
    assert "sending myself" not in again.stdout
    _assert_bit_equal(tmp_path / "final.pt", reference)
