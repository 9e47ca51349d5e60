"""Preemption under Slurm: the signal makes the job checkpoint and requeue, and its next run continues.

The job is what ``ddpkit slurm --preempt-signal USR1`` writes: Slurm would send
SIGUSR1 to the batch shell before the time limit (``--signal=B:USR1@90``);
the test sends it itself once the first epoch's checkpoint is written. The
shell's trap passes it to srun, srun to both workers; they agree on a step,
write one checkpoint, exit, and the script requeues the job. Slurm starts it
again (SLURM_RESTART_COUNT=1) and the workers resume from that checkpoint,
at that step, without being told to.
"""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path

import pytest

from tests.cli_runner import PYTHONPATH
from tests.helpers.slurm import SlurmCluster

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

EPOCHS = 3
STEPS_PER_EPOCH = 938  # Fashion-MNIST's 60,000 samples in global batches of 64


def wait_for_line(path: Path, pattern: str, timeout: float) -> str:
    """The first line of the file at path that matches pattern, once it is written."""
    deadline = time.monotonic() + timeout
    while True:
        text = path.read_text(errors="replace") if path.exists() else ""
        match = re.search(pattern, text, re.MULTILINE)
        if match:
            return match.group(0)
        assert time.monotonic() < deadline, f"no line matching {pattern!r} in {path} after {timeout} s:\n{text}"
        time.sleep(0.2)


@pytest.mark.timeout(900)
def test_preempted_training_checkpoints_requeues_and_continues_from_that_step(slurm_cluster: SlurmCluster, tmp_path):
    argv = [
        sys.executable, "-m", "ddpkit", "slurm", "submit=true", "launch=srun", "tasks_per_node=2",
        "time=30", "preempt_signal=USR1", f"project_root={tmp_path}", "output=train-%j.out",
        "progress=false", f"epochs={EPOCHS}",
    ]
    job_id = int(slurm_cluster.run(argv, env={**slurm_cluster.env, "PYTHONPATH": PYTHONPATH}).stdout)
    output = tmp_path / f"train-{job_id}.out"
    first = f"step-{STEPS_PER_EPOCH:09d}"
    wait_for_line(output, rf"^\[rank 0/2\] checkpoint \S*{first} \(epoch_end", timeout=600)

    # What Slurm does 90 s before the time limit (--signal=B:USR1@90).
    slurm_cluster.signal_batch_shell(job_id, "USR1")

    result = slurm_cluster.wait(job_id, timeout=600)
    assert result.state == "COMPLETED", result.output
    assert result.restarts == 1, result.output
    log = result.output  # --open-mode=append: both runs
    (preempted,) = re.findall(r"preempted by SIGUSR1 after global step (\d+): checkpoint (\S+) is complete", log)
    step, checkpoint = int(preempted[0]), preempted[1]
    assert STEPS_PER_EPOCH < step < EPOCHS * STEPS_PER_EPOCH
    assert Path(checkpoint).name == f"step-{step:09d}"
    # The requeued run starts where the first one stopped: the same checkpoint, the same step.
    epoch, in_epoch = divmod(step, STEPS_PER_EPOCH)
    resumed = re.findall(r"resumed from (\S+) \(global step (\d+): epoch (\d+), step (\d+) of (\d+)\)", log)
    assert [(Path(p).name, int(s), int(e), int(i), int(n)) for p, s, e, i, n in resumed] == [
        (f"step-{step:09d}", step, epoch + 1, in_epoch, STEPS_PER_EPOCH)
    ]
    assert log.index("preempted by SIGUSR1") < log.index("resumed from") < log.index("[rank 0/2] done:")
    # The requeued job (same id) continued in the same run folder.
    assert (tmp_path / "runs" / "latest").resolve() == tmp_path / "runs" / "mlp-fashion-mnist" / f"slurm-{job_id}"
    summary = json.loads((tmp_path / "runs" / "latest" / "summary.json").read_text())
    assert summary["global_steps"] == EPOCHS * STEPS_PER_EPOCH and summary["world_size"] == 2
