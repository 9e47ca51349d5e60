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

from ddpkit.checkpoint.disk.format import list_checkpoints, read_manifest
from tests.helpers.launch_in_process import Commands

SCRIPT = Path(__file__).resolve().parent / "scripts" / "own_cnn.py"
SEED = 4242
"""Seed of the interruption points."""
STEPS = 26
"""Global steps of the script's 2 epochs: 13 global batches of 16 (the last of 8) each."""


def _run(
    commands: Commands,
    folder: Path,
    *options: str,
    every_steps: int,
    num_workers: int = 2,
    env: dict[str, str] | None = None,
):
    return commands.run(
        "run",
        "show_ranks=all",  # the start lines of every rank are read
        *options,
        str(SCRIPT),
        "--out",
        str(folder / "ckpt"),
        "--final",
        str(folder / "final.pt"),
        "--every-steps",
        str(every_steps),
        "--num-workers",
        str(num_workers),
        cwd=folder,
        env=env,
    )


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
def runs(tmp_path_factory) -> dict:
    """Every ``ddpkit run`` of this module, in this process with one worker server shared by all of them.

    The commands' results and what the tests inspect between two of them, by name:

    - reference: the final weights of one uninterrupted ``ddpkit run nproc=2`` (checkpoints at epoch ends
      only). It loads data in the training processes (num_workers=0) and the runs under test with 2
      DataLoader workers each: equal weights also show that the loader's workers change nothing
      (per-sample seeding).
    - killed: a run whose rank KILL_RANK sends itself SIGKILL after step KILL_AT, restarted (max_restarts=1).
    - preempted, preempted_checkpoints, again: a run whose rank sends itself SIGTERM, the complete
      checkpoints it left, and the same command run again.
    """
    results = {}
    with Commands() as commands:
        folder = tmp_path_factory.mktemp("reference")
        out = _run(commands, folder, "nproc=2", every_steps=0, num_workers=0)
        assert out.returncode == 0, out.stdout + out.stderr
        assert _starts(out.stdout) == [("0", 0, False), ("1", 0, False)]
        results["reference"] = torch.load(folder / "final.pt", weights_only=True)

        folder = results["killed_folder"] = tmp_path_factory.mktemp("killed")
        env = {"KILL_AT_STEP": str(KILL_AT), "KILL_RANK": str(KILL_RANK)}
        results["killed"] = _run(commands, folder, "nproc=2", "max_restarts=1", every_steps=2, env=env)

        # No checkpoint cadence: the one mid-epoch checkpoint is the preemption's own.
        folder = results["preempted_folder"] = tmp_path_factory.mktemp("preempted")
        env = {"KILL_AT_STEP": str(TERM_AT), "KILL_RANK": str(TERM_RANK), "SIGNAL": "SIGTERM"}
        results["preempted"] = _run(commands, folder, "nproc=2", every_steps=0, env=env)
        results["preempted_checkpoints"] = [info for info in list_checkpoints(folder / "ckpt") if info.complete]
        results["preempted_final_exists"] = (folder / "final.pt").exists()
        if results["preempted"].returncode == 75:
            results["again"] = _run(commands, folder, "nproc=2", every_steps=0, env=env)  # the same command
    return results


_kill_rng = random.Random(SEED)
KILL_AT, KILL_RANK = _kill_rng.randint(3, STEPS - 2), _kill_rng.randint(0, 1)
"""Where the SIGKILL falls: after optimizer step KILL_AT, on rank KILL_RANK."""
_term_rng = random.Random(SEED + 1)
TERM_AT, TERM_RANK = _term_rng.randint(2, STEPS - 6), _term_rng.randint(0, 1)
"""Where the SIGTERM falls."""


def test_a_killed_rank_is_restarted_and_the_run_ends_bit_identical(runs):
    print(f"seed {SEED}: SIGKILL to rank {KILL_RANK} after optimizer step {KILL_AT}")
    out = runs["killed"]
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"rank {KILL_RANK}: sending myself SIGKILL after step {KILL_AT}" in out.stdout
    # Killed before ckpt.step() counted step KILL_AT: the newest checkpoint is the one before it
    # (every 2 steps, and at the end of epoch 1 after step 13); step KILL_AT is computed again.
    saved = max(2 * ((KILL_AT - 1) // 2), 13 if KILL_AT > 13 else 0)
    assert _starts(out.stdout) == [("0", 0, False), ("0", saved, True), ("1", 0, False), ("1", saved, True)]
    _assert_bit_equal(runs["killed_folder"] / "final.pt", runs["reference"])


def test_sigterm_checkpoints_exits_75_and_the_same_command_completes_bit_identical(runs):
    print(f"seed {SEED + 1}: SIGTERM to rank {TERM_RANK} after optimizer step {TERM_AT}")
    first, folder = runs["preempted"], runs["preempted_folder"]
    assert first.returncode == 75, first.stdout + first.stderr
    assert "ddpkit: preempted: a worker exited with status 75; run the same command to continue" in first.stderr
    stop = re.search(r"preempted by SIGTERM after global step (\d+): checkpoint (\S+) is complete", first.stderr)
    assert stop is not None, first.stderr
    step = int(stop[1])
    # The ranks agree on the signal a few steps later at most (sync_seconds=0.005 in the script).
    assert TERM_AT <= step < STEPS
    newest = runs["preempted_checkpoints"][-1]
    assert (newest.global_step, str(newest.path)) == (step, stop[2])
    assert read_manifest(newest.path)["reason"] == "preempted"
    assert not runs["preempted_final_exists"]

    again = runs["again"]
    assert again.returncode == 0, again.stdout + again.stderr
    assert _starts(again.stdout) == [("0", step, True), ("1", step, True)]
    assert "sending myself" not in again.stdout
    _assert_bit_equal(folder / "final.pt", runs["reference"])
