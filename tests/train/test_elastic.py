"""Elastic restarts through ddpkit's launcher: a killed worker costs a restart, not the run.

The jobs run in this process (``ddpkit.commands.dispatch.main``, tests/helpers/launch_in_process.py), their workers forked
from a worker server as the command's are: what is tested is the launcher's restarts, not the command's process.
"""

import random

import pytest

from tests.helpers.launch_in_process import Commands
from tests.train.checkpoint_helpers import (
    CLI_TOTAL_STEPS,
    assert_same_weights,
    final_weights,
    reference_weights,
    run_job_here,
)


@pytest.mark.slow
def test_sigkill_of_one_worker_at_a_random_step_restarts_and_ends_bit_equal(tmp_path, seed):
    step = random.Random(seed).randrange(1, CLI_TOTAL_STEPS + 1)
    print(f"SIGKILL to rank 1 at global step {step}")
    with Commands() as commands:
        reference = reference_weights(commands)
        out = run_job_here(
            commands,
            tmp_path,
            "max_restarts=1",
            env={"DDPKIT_TEST_SIGNAL_STEP": str(step), "DDPKIT_TEST_SIGNAL": "SIGKILL"},
        )
    assert out.returncode == 0, f"seed {seed}: killed at step {step}:\n{out.stderr}"
    if step > 4:  # a checkpoint existed when rank 1 died
        assert "restart 1: resuming from the newest checkpoint" in out.stderr, out.stderr
        assert "resumed from" in out.stderr, out.stderr
    assert_same_weights(final_weights(tmp_path), reference, f"seed {seed}: rank 1 killed at step {step}")


@pytest.mark.slow
def test_always_failing_worker_gives_up_after_exactly_max_restarts(tmp_path):
    attempts = tmp_path / "attempts"
    with Commands() as commands:
        out = run_job_here(
            commands,
            tmp_path,
            "max_restarts=2",
            "model=tests.train.checkpoint_helpers:always_fails",
            env={"DDPKIT_TEST_ATTEMPTS": str(attempts)},
        )
    assert out.returncode == 1, out.stderr
    assert attempts.read_text().split() == ["0", "1", "2"]  # the first run and exactly 2 restarts
    assert "error: the job failed after 2 restart(s) (max_restarts=2)" in out.stderr, out.stderr
    assert "error: worker rank 1 failed (exit code 1): RuntimeError: rank 1 fails on purpose" in out.stderr
