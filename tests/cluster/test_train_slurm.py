"""Training jobs on a real one-node Slurm cluster, each with 2 srun tasks, from ``ddpkit slurm submit=true``.

W1 trains (its first steps) and leaves its run folder. A second job is
preempted and requeued: its next run continues from the preemption's
checkpoint. The W1 job runs beside the preempted one (the node has CPUs for
both), so that its training fills the preempted job's waits: for the
signal, and for Slurm to start it again.

Preemption: the job is what ``ddpkit slurm --preempt-signal USR1`` writes:
Slurm would send SIGUSR1 to the batch shell before the time limit
(``--signal=B:USR1@90``); the test sends it itself once the first epoch's
checkpoint is written. The shell's trap passes it to srun, srun to both
workers; they agree on a step, write one checkpoint, exit, and the script
requeues the job. Slurm starts it again (SLURM_RESTART_COUNT=1) and the
workers resume from that checkpoint, at that step, without being told to.
Its data is the user's own (``dataset=module:function`` from the project
folder): a few synthetic batches per epoch, whose loading is slow in the
first run after its first epoch, as a slow file system would make it. So
the signal always lands while the first run is still training (it has many
seconds of work left), and the requeued run, at full speed, ends in a
moment. Preemption agreements are frequent (``checkpoint.sync_seconds``), so
the workers stop within a step or two of the signal.

``ddpkit slurm`` runs in the test's own process (``ddpkit.commands.dispatch.main``;
tests/cluster/test_slurm_cluster.py runs the command itself). sbatch passes
its environment on to the job: the workers import this checkout.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from ddpkit.commands.dispatch import main
from ddpkit.data.datasets import FASHION_MNIST
from ddpkit.data.sources import DataNotFoundError, locate
from tests.cli_runner import PYTHONPATH
from tests.cluster.short_w1 import W1_SHORT, W1_SHORT_ACCURACY_FLOOR, W1_SHORT_STEPS
from tests.helpers.slurm import SlurmCluster, derived_port

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

EPOCHS = 4
SAMPLES = 640
STEPS_PER_EPOCH = SAMPLES // 64  # global batches of 64
SLOW_SECONDS_PER_SAMPLE = 0.01
"""After its first epoch, the first run loads each sample this long: a step takes 0.32 s per worker, and the
epochs left hold (EPOCHS - 1) * STEPS_PER_EPOCH steps, about 10 s for the signal to come."""

# The user's dataset: learnable synthetic images; slow to load after the first epoch of the first run only.
DATASET = textwrap.dedent(
    f"""\
    import os, time
    import torch
    from torch.utils.data import Dataset

    class Images(Dataset):
        def __init__(self, count, seed, slow_after):
            generator = torch.Generator().manual_seed(seed)
            self.images = torch.rand(count, 784, generator=generator)
            self.labels = (self.images @ torch.randn(784, 10, generator=torch.Generator().manual_seed(0))).argmax(1)
            self.slow_after, self.loaded = slow_after, 0

        def __len__(self):
            return len(self.images)

        def __getitem__(self, index):
            self.loaded += 1
            if self.loaded > self.slow_after:
                time.sleep({SLOW_SECONDS_PER_SAMPLE})
            return self.images[index], self.labels[index]

    def build():
        first_run = int(os.environ.get("SLURM_RESTART_COUNT", "0")) == 0
        per_worker = {SAMPLES} // int(os.environ["SLURM_NTASKS"])  # samples one worker loads per epoch
        slow_after = per_worker if first_run else float("inf")
        return Images({SAMPLES}, 1, slow_after), Images({SAMPLES} // 4, 2, float("inf"))
    """
)


@dataclass(frozen=True)
class W1Job:
    """The W1 job submitted by the w1_job fixture."""

    job_id: int
    project: Path


@pytest.fixture(scope="module")
def w1_job(slurm_cluster: SlurmCluster, tmp_path_factory) -> W1Job | None:
    """A W1 job submitted with ``ddpkit slurm submit=true``, still running; None without the Fashion-MNIST files."""
    try:
        locate(FASHION_MNIST, download=False)
    except DataNotFoundError:
        return None  # test_ddpkit_slurm_submit_trains_w1 skips (its fashion_mnist fixture says why)
    project = tmp_path_factory.mktemp("w1")
    words = [
        "slurm",
        "submit=true",
        "launch=srun",
        "tasks_per_node=2",
        f"project_root={project}",
        "output=logs/train-%j.out",
        "job_name=w1",
        "progress=false",
        *W1_SHORT,
    ]
    printed = io.StringIO()
    with pytest.MonkeyPatch.context() as monkeypatch, contextlib.redirect_stdout(printed):
        slurm_cluster.patch_environ(monkeypatch, PYTHONPATH=PYTHONPATH)
        assert main(words) == 0
    return W1Job(int(printed.getvalue()), project)


def wait_for_line(path: Path, pattern: str, timeout: float) -> str:
    """The first line of the file at path that matches pattern, once it is written."""
    deadline = time.monotonic() + timeout
    while True:
        text = path.read_text(errors="replace") if path.exists() else ""
        match = re.search(pattern, text, re.MULTILINE)
        if match:
            return match.group(0)
        assert time.monotonic() < deadline, f"no line matching {pattern!r} in {path} after {timeout} s:\n{text}"
        time.sleep(0.05)


@pytest.mark.timeout(300)
def test_preempted_training_checkpoints_requeues_and_continues_from_that_step(
    slurm_cluster: SlurmCluster, w1_job: W1Job | None, tmp_path, monkeypatch, capsys
):
    # w1_job: submitted first, so that W1 trains while this job waits (to be signalled, to start again).
    (tmp_path / "slow_images.py").write_text(DATASET)
    words = [
        "slurm",
        "submit=true",
        "launch=srun",
        "tasks_per_node=2",
        "time=30",
        "preempt_signal=USR1",
        f"project_root={tmp_path}",
        "output=train-%j.out",
        "progress=false",
        "dataset=slow_images:build",
        f"epochs={EPOCHS}",
        "checkpoint.sync_seconds=0.01",
    ]
    # ddpkit slurm in this process (tests/cluster/test_slurm_cluster.py runs the command); sbatch passes its
    # environment on to the job: the workers import this checkout.
    slurm_cluster.patch_environ(monkeypatch, PYTHONPATH=PYTHONPATH)
    assert main(words) == 0
    job_id = int(capsys.readouterr().out)
    output = tmp_path / f"train-{job_id}.out"
    first = f"step-{STEPS_PER_EPOCH:09d}"
    wait_for_line(output, rf"^\[rank 0/2\] checkpoint \S*{first} \(epoch_end", timeout=180)

    # What Slurm does 90 s before the time limit (--signal=B:USR1@90).
    slurm_cluster.signal_batch_shell(job_id, "USR1")

    result = slurm_cluster.wait(job_id, timeout=180)
    assert result.state == "COMPLETED", result.output
    assert result.exit_code == "0:0", result.output
    assert result.restarts == 1, result.output
    log = result.output  # --open-mode=append: both runs
    (preempted,) = re.findall(r"preempted by SIGUSR1 after global step (\d+): checkpoint (\S+) is complete", log)
    step, checkpoint = int(preempted[0]), preempted[1]
    assert STEPS_PER_EPOCH < step < EPOCHS * STEPS_PER_EPOCH
    assert Path(checkpoint).name == f"step-{step:09d}"
    # The requeued run starts where the first one stopped: the same checkpoint, the same step.
    epoch, in_epoch = divmod(step, STEPS_PER_EPOCH)
    resumed = re.findall(
        r"resumed from (\S+) \(global step (\d+): (\d+) epoch\(s\) complete and (\d+) of (\d+) steps of the next\)", log
    )
    assert [(Path(p).name, int(s), int(e), int(i), int(n)) for p, s, e, i, n in resumed] == [
        (f"step-{step:09d}", step, epoch, in_epoch, STEPS_PER_EPOCH)
    ]
    assert log.index("preempted by SIGUSR1") < log.index("resumed from") < log.index("[rank 0/2] done:")
    # Both runs are the job's two tasks on this node, meeting at the same checked port, derived from the job id
    # unless something on this shared machine listened there.
    masters = re.findall(r"^\[rank 0/2\] slurm: world_size 2 on 1 node\(s\), master (\S+):(\d+),", log, re.MULTILINE)
    assert len(masters) == 2 and len(set(masters)) == 1, log
    host, port = masters[0]
    assert host == slurm_cluster.node_name and derived_port(job_id) <= int(port) < derived_port(job_id) + 10
    # The requeued job (same id) continued in the same run folder.
    latest = (tmp_path / "runs" / "latest").resolve()
    assert latest == tmp_path / "runs" / "mlp-slow_images.build" / f"slurm-{job_id}"
    summary = json.loads((latest / "summary.json").read_text())
    assert summary["global_steps"] == EPOCHS * STEPS_PER_EPOCH and summary["world_size"] == 2


@pytest.mark.timeout(600)
def test_ddpkit_slurm_submit_trains_w1(slurm_cluster: SlurmCluster, w1_job: W1Job | None, fashion_mnist):
    assert w1_job is not None
    job_id, project = w1_job.job_id, w1_job.project

    result = slurm_cluster.wait(job_id, timeout=500)

    assert result.state == "COMPLETED", result.output
    assert result.exit_code == "0:0"
    assert result.info["StdOut"] == str(project / "logs" / f"train-{job_id}.out")
    assert "[rank 0/2] slurm: world_size 2 on 1 node(s)" in result.output
    done = r"\[rank 0/2\] done: mlp on fashion-mnist, 2 worker\(s\), test accuracy ([0-9.]+)%"
    (accuracy,) = re.findall(done, result.output)
    assert float(accuracy) >= 100 * W1_SHORT_ACCURACY_FLOOR, result.output
    # The job ran in the project root, into a run folder of its own named by the job id; runs/latest points to it.
    assert (project / "runs" / "latest").resolve() == project / "runs" / "mlp-fashion-mnist" / f"slurm-{job_id}"
    summary = json.loads((project / "runs" / "latest" / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["global_steps"] == W1_SHORT_STEPS
    assert summary["test"]["accuracy"] == pytest.approx(float(accuracy) / 100, abs=0.00006)
