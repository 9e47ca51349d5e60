"""Elastic Slurm jobs: ``ddpkit slurm nodes=MIN-MAX`` writes them, and a real one trains, is requeued and rejoins.

The script's lines are checked as text (the words a user passes, the lines
they become). The real jobs run on the suite's one-node Slurm cluster
(tests/helpers/slurm.py), so the allocation has one node of the 1-2 asked:
the job starts one launcher there (ddpkit's, or torchrun), which meets
itself in torch's dynamic rendezvous at the first node and trains on
the node that is there. A requeued job (``scontrol requeue``, as an
administrator or a preemption does) runs again under the same job id: the
same rendezvous id and run folder, resuming from the newest checkpoint.
Losing a node of a running job needs two nodes and is tested with network
namespaces (tests/traps, benchmarks/elastic_recovery.py).
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import subprocess
import textwrap

import pytest

from ddpkit.commands.dispatch import main
from tests.cli_runner import PYTHONPATH
from tests.cluster.test_train_slurm import wait_for_line
from tests.helpers.slurm import SlurmCluster

SAMPLES, STEPS_PER_EPOCH, EPOCHS = 640, 10, 3  # global batches of 64
SLOW_SECONDS_PER_SAMPLE = 0.01
"""The first run loads each sample this long (0.32 s a step at 2 workers): ample time to requeue it mid-run."""

# The user's data: learnable synthetic images, slow to load in the job's first run only.
DATASET = textwrap.dedent(
    f"""\
    import os, time
    import torch
    from torch.utils.data import Dataset

    class Images(Dataset):
        def __init__(self, count, seed, slow):
            generator = torch.Generator().manual_seed(seed)
            self.images = torch.rand(count, 784, generator=generator)
            self.labels = (self.images @ torch.randn(784, 10, generator=torch.Generator().manual_seed(0))).argmax(1)
            self.slow = slow

        def __len__(self):
            return len(self.images)

        def __getitem__(self, index):
            if self.slow:
                time.sleep({SLOW_SECONDS_PER_SAMPLE})
            return self.images[index], self.labels[index]

    def build():
        first_run = int(os.environ.get("SLURM_RESTART_COUNT", "0")) == 0
        return Images({SAMPLES}, 1, first_run), Images({SAMPLES} // 4, 2, False)
    """
)


def script_of(capsys, *words: str) -> str:
    """The script ``ddpkit slurm`` prints for words (with a venv, so it runs anywhere)."""
    assert main(["slurm", "venv=/home/ada/venv", "project_root=/home/ada/ddp", *words]) == 0
    return capsys.readouterr().out


def launch_lines(script: str) -> str:
    """The launch command of a script without preemption, its continuation lines joined."""
    return script.split("# Training\n", 1)[1].replace(" \\\n    ", " ").strip()


@pytest.mark.parametrize("nodes", ["1-2", "1:2"])
def test_a_node_range_writes_an_elastic_job_with_ddpkits_launcher_on_each_node(nodes, capsys):
    script = script_of(capsys, f"nodes={nodes}", "tasks_per_node=2", "cpus_per_task=3", "model=mlp")

    directives = re.findall(r"^#SBATCH (.*)$", script, re.MULTILINE)
    assert directives[1:4] == ["--nodes=1-2", "--no-kill", "--ntasks-per-node=2"]
    assert launch_lines(script) == (
        'srun --nodes="$SLURM_JOB_NUM_NODES" --ntasks="$SLURM_JOB_NUM_NODES" --ntasks-per-node=1 --cpus-per-task=6 '
        "--no-kill --kill-on-bad-exit=0 --wait=0 "
        'python -m ddpkit train nnodes=1:2 nproc=2 master_addr="$MASTER_ADDR" '
        'master_port="$MASTER_PORT" model=mlp'
    )


def test_an_elastic_torchrun_job_uses_the_node_range_and_restarts_for_the_losses(capsys):
    script = script_of(capsys, "nodes=2-4", "launch=torchrun", "command=python my.py", "--", "--lr", "0.1")

    assert launch_lines(script) == (
        'srun --nodes="$SLURM_JOB_NUM_NODES" --ntasks="$SLURM_JOB_NUM_NODES" --ntasks-per-node=1 --cpus-per-task=1 '
        "--no-kill --kill-on-bad-exit=0 --wait=0 "
        "torchrun --nnodes=2:4 --nproc-per-node=1 --max-restarts=3 "
        '--rdzv-backend=c10d --rdzv-endpoint="$MASTER_ADDR:$MASTER_PORT" --rdzv-id="$SLURM_JOB_ID" '
        "--no-python python my.py --lr 0.1"
    )


def test_an_elastic_job_runs_the_users_script_under_ddpkit_run(capsys):
    script = script_of(capsys, "nodes=1-3", "command=python train.py", "--", "--epochs", "2")

    assert launch_lines(script).endswith(
        'python -m ddpkit run nnodes=1:3 nproc=1 master_addr="$MASTER_ADDR" master_port="$MASTER_PORT" '
        "train.py --epochs 2"
    )


def test_max_restarts_goes_to_the_launcher_of_each_node(capsys):
    script = script_of(capsys, "nodes=1-3", "max_restarts=2", "model=mlp")

    assert launch_lines(script).endswith(
        'python -m ddpkit train nnodes=1:3 nproc=1 max_restarts=2 master_addr="$MASTER_ADDR" '
        'master_port="$MASTER_PORT" model=mlp'
    )


def test_a_fixed_job_is_unchanged(capsys):
    script = script_of(capsys, "nodes=2")

    assert "#SBATCH --nodes=2\n" in script and "--no-kill" not in script and "nnodes" not in script


@pytest.mark.parametrize(
    ("words", "message"),
    [
        (["nodes=3-2"], "error: nodes=3-2 has more nodes at least than at most; write nodes=MIN-MAX, e.g. nodes=2-3"),
        (["nodes=1-2", "launch=mpirun"], "error: launch=mpirun cannot run an elastic job (nodes=MIN-MAX)"),
        (["nodes=1-2", "command=./train.sh"], "error: command='./train.sh' is not a Python program"),
        (["nodes=1-x"], "error: bad value for 'nodes'"),
    ],
)
def test_a_wrong_elastic_job_is_one_line(words, message, capsys):
    assert main(["slurm", "venv=/v", *words]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith(message) and err.count("\n") == 1, err


def submit(cluster: SlurmCluster, monkeypatch, capsys, words: list[str]) -> int:
    """Submit ``ddpkit slurm submit=true words`` in this process (sbatch passes the environment on); the job id."""
    cluster.patch_environ(monkeypatch, PYTHONPATH=PYTHONPATH)
    with contextlib.redirect_stderr(io.StringIO()):  # the node-local warning of a project under /tmp
        assert main(["slurm", "submit=true", *words]) == 0
    return int(capsys.readouterr().out)


@pytest.mark.cluster
@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("launch", ["srun", "torchrun"])
def test_a_requeued_elastic_job_rejoins_its_run_and_resumes(launch, slurm_cluster, tmp_path, monkeypatch, capsys):
    (tmp_path / "slow_images.py").write_text(DATASET)
    words = [
        "nodes=1-2",
        "tasks_per_node=2",
        f"launch={launch}",
        "requeue=true",
        f"project_root={tmp_path}",
        "output=train-%j.out",
        "progress=false",
        "dataset=slow_images:build",
        f"epochs={EPOCHS}",
        "checkpoint.every_steps=2",
        # One node is all this cluster has: the rendezvous need not wait long for a second.
        *(["rdzv_last_call=1"] if launch == "srun" else []),
    ]
    job_id = submit(slurm_cluster, monkeypatch, capsys, words)
    output = tmp_path / f"train-{job_id}.out"
    wait_for_line(output, r"^\[rank 0/2\] checkpoint \S*step-000000004 ", timeout=180)

    # What an administrator, or a preemption of a requeueable job, does: the job stops and goes back to the queue.
    subprocess.run(["scontrol", "requeue", str(job_id)], env=slurm_cluster.env, check=True, capture_output=True)

    result = slurm_cluster.wait(job_id, timeout=200)
    assert result.state == "COMPLETED" and result.exit_code == "0:0", result.output
    assert result.restarts == 1, result.output
    log = result.output  # --open-mode=append: both runs
    # The second run rejoined the same run (its folder named by the job id) and resumed from its newest checkpoint.
    folder = tmp_path / "runs" / "mlp-slow_images.build" / f"slurm-{job_id}"
    (resumed,) = re.findall(r"resumed from (\S+) \(global step (\d+)", log)
    assert (tmp_path / resumed[0]).parent == folder / "checkpoints"  # relative to the job's folder
    assert 4 <= int(resumed[1]) < EPOCHS * STEPS_PER_EPOCH
    assert (tmp_path / "runs" / "latest").resolve() == folder
    summary = json.loads((folder / "summary.json").read_text())
    assert summary["global_steps"] == EPOCHS * STEPS_PER_EPOCH and summary["world_size"] == 2
