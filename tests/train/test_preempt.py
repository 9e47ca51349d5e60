"""Preemption: a signal to any worker or to the launcher ends in one checkpoint and a clean resume."""

import os
import signal

import pytest
import torch

from ddpkit.checkpoint.disk.format import checkpoint_name
from ddpkit.checkpoint.manager.preemption import (
    EXIT_PREEMPTED,
    MAX_SYNC_INTERVAL,
    Agreement,
    PreemptionSignals,
    requeue_slurm_job,
)
from tests.helpers.launch_in_process import Commands
from tests.train.checkpoint_helpers import (
    assert_same_weights,
    final_weights,
    manifests,
    reference_weights,
    run_job,
    run_job_here,
)


def test_handler_records_the_signal_and_close_restores_the_previous_one():
    before = signal.getsignal(signal.SIGUSR2)
    signals = PreemptionSignals(["SIGUSR2"])
    signals.install()
    try:
        assert signals.received == 0
        os.kill(os.getpid(), signal.SIGUSR2)
        assert signals.received == signal.SIGUSR2
    finally:
        signals.close()
    assert signal.getsignal(signal.SIGUSR2) == before


def test_agreement_adapts_its_interval_to_the_step_time():
    agreement = Agreement(1, True, torch.device("cpu"), sync_seconds=3600.0, every_seconds=0.0)
    agreement.start(100)
    assert agreement.next_step == 101  # the first agreement right after the first step
    intervals = []
    for _ in range(20):  # an hour of (fast) steps wanted: the interval doubles up to the cap
        step = agreement.next_step
        assert agreement.agree(step, 0) == (0, False)
        intervals.append(agreement.next_step - step)
    assert intervals[:5] == [2, 4, 8, 16, 32]
    assert intervals[-1] == MAX_SYNC_INTERVAL
    assert agreement.agree(agreement.next_step, signal.SIGTERM)[0] == signal.SIGTERM


def test_timed_checkpoint_comes_due():
    agreement = Agreement(1, True, torch.device("cpu"), sync_seconds=1.0, every_seconds=1e-9)
    assert agreement.agree(1, 0) == (0, True)


def test_requeue_outside_slurm_and_failed_requeue_are_reported_not_raised():
    assert "not a Slurm job" in requeue_slurm_job({})
    message = requeue_slurm_job({"SLURM_JOB_ID": "999999"})  # no such job (and maybe no Slurm at all)
    assert "999999" in message and "resubmit it with resume=auto" in message


@pytest.fixture(scope="module")
def jobs(tmp_path_factory) -> dict:
    """The jobs of the tests below, by name, with one worker server shared by those run in this process.

    - one_worker: (folder, result) of a job whose rank 1 alone gets SIGUSR1 during step 6, with max_restarts=1,
      saving in the background (checkpoint.async_save=true: the preemption waits for its write);
    - launcher: (folder, result, the manifests after it, the result of resume=auto) of a job whose rank 1 sends
      SIGTERM to the launcher during step 6. That job is started as a command of its own: its launcher, the
      process the signal goes to, must not be the test's.
    """
    results = {}
    with Commands() as commands:
        reference_weights(commands)
        folder = tmp_path_factory.mktemp("one-worker")
        results["one_worker"] = (
            folder,
            run_job_here(
                commands,
                folder,
                "max_restarts=1",
                "checkpoint.async_save=true",
                env={"DDPKIT_TEST_SIGNAL_STEP": "6", "DDPKIT_TEST_SIGNAL": "SIGUSR1"},
            ),
        )

        folder = tmp_path_factory.mktemp("launcher")
        out = run_job(
            folder,
            env={
                "DDPKIT_TEST_SIGNAL_STEP": "6",
                "DDPKIT_TEST_SIGNAL": "SIGTERM",
                "DDPKIT_TEST_SIGNAL_TARGET": "parent",
                "DDPKIT_TEST_STEP_SLEEP": "0.05",
            },
        )
        saved = manifests(folder)
        again = run_job_here(commands, folder, "resume=auto") if out.returncode == EXIT_PREEMPTED else None
        results["launcher"] = (folder, out, saved, again)
    return results


@pytest.mark.slow
def test_signal_to_one_worker_checkpoints_once_and_the_restart_continues_there(jobs):
    # Rank 1 alone gets SIGUSR1 during step 6: both ranks agree after step 6, save it, exit 75;
    # the launcher restarts them (max_restarts=1) and they resume from that checkpoint.
    folder, out = jobs["one_worker"]
    assert out.returncode == 0, out.stderr
    preempted = [m for m in manifests(folder) if m["reason"] == "preempted"]
    assert [m["global_step"] for m in preempted] == [6], out.stderr
    assert "preempted by SIGUSR1 after global step 6" in out.stderr, out.stderr
    assert f"resumed from {folder}/checkpoints/{checkpoint_name(6)}" in out.stderr, out.stderr
    assert_same_weights(final_weights(folder), reference_weights(), "preempted at step 6")


@pytest.mark.slow
def test_sigterm_to_the_launcher_stops_with_75_and_resume_auto_continues(jobs):
    # Rank 1 sends SIGTERM to the launcher during step 6; torch's agent passes it to the workers.
    folder, out, saved, again = jobs["launcher"]
    assert out.returncode == EXIT_PREEMPTED, out.stderr
    assert "ddpkit: preempted by SIGTERM: the workers checkpointed and exited 75;" in out.stderr, out.stderr
    assert "resume=auto" in out.stderr, out.stderr
    preempted = [m for m in saved if m["reason"] == "preempted"]
    assert len(preempted) == 1 and 6 <= preempted[0]["global_step"] < 32, out.stderr
    step = preempted[0]["global_step"]
    assert saved[-1]["global_step"] == step  # nothing was trained or saved after it

    assert again.returncode == 0, again.stderr
    assert f"resumed from {folder}/checkpoints/{checkpoint_name(step)}" in again.stderr, again.stderr
    assert_same_weights(final_weights(folder), reference_weights(), f"preempted at step {step}")
